"""Simulated time of each round, from the device/network time model (``fedswarm/timemodel.py``).

:func:`make_round_timer` turns a run config into the ``sim_time(round, traffic)`` callback
the engines hand to ``run_server``; the recorder stores its value as the round's
``sim_time_s``. It is **simulated** seconds on the devices named by ``--devices``, not
wall time, and it is None when the run names no devices. The batched engine computes the same
figure from its own bookkeeping (:mod:`fedswarm.sim.batched_simtime`).

- Federated rounds (``sync_round_time_s``): ``max`` over the nodes that replied of
  download + compute + upload, with each node's bytes as measured on the grid and its
  compute from the samples it trained on. The server's link is not a bottleneck unless
  ``server_link`` is given (its bandwidth is then shared by the round's nodes).
- Decentralized rounds (``gossip_round_time_s``): one gossip iteration, ``max`` over the
  nodes of compute plus sending its message to its neighbours over its own uplink. The
  router's server hops are not part of it: they are an artifact of running gossip on
  Flower. D-PSGD in its paper's order (``cta``) overlaps the two.

Asynchronous algorithms do not use rounds for time: they run on the virtual clock of
``sim/async_engine.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Message

from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout
from fedswarm.server.metered_grid import Traffic
from fedswarm.timemodel import (
    BUILTIN_PROFILES,
    Link,
    Profile,
    gossip_round_time_s,
    load_profiles,
    parse_devices,
    sync_round_time_s,
)
from fedswarm.strategies import registry
from fedswarm.strategies.decentralized.node import message_nbytes_of
from fedswarm.algorithms.decentralized.topology import make_topology
from fedswarm.tasks import get_task
from fedswarm.wire import PAYLOAD_ARRAYS, PAYLOAD_META, vector_to_arrayrecord

__all__ = ["RoundTimer", "node_profiles", "model_message_nbytes", "samples_of", "make_round_timer", "make_node_timer"]

RoundTimer = Callable[[int, Traffic], "float | None"]


def node_profiles(cfg: RunConfig) -> list[Profile] | None:
    """Each node's profile (index = partition id) from ``cfg.devices`` and
    ``cfg.profiles``; None when the run names no devices."""
    if cfg.devices is None:
        return None
    profiles = load_profiles(cfg.profiles) if cfg.profiles else BUILTIN_PROFILES
    return [profiles[name] for name in parse_devices(cfg.devices, cfg.clients, profiles)]


def model_message_nbytes(cfg: RunConfig) -> int:
    """Serialized size of one message carrying the task's full float32 model."""
    import torch

    from flwr.app import ConfigRecord

    d = ParamLayout.from_module(get_task(cfg.task).model(cfg.seed)).d
    return message_nbytes_of(vector_to_arrayrecord(torch.zeros(d)), ConfigRecord({"kind": "dense"}))


def _partition_of(msg: Message, n: int) -> int | None:
    """The node's index: the ``partition-id`` its reply reports (in its ``node`` record, or
    among a decentralized node's metrics), else the in-process engine's convention (node id =
    partition id + 1)."""
    node = msg.content.config_records.get("node") if msg.has_content() else None
    if node is not None and "partition-id" in node:
        return int(node["partition-id"])
    metrics = next(iter(msg.content.metric_records.values()), None) if msg.has_content() else None
    if metrics is not None and "partition-id" in metrics:
        return int(metrics["partition-id"])
    nid = msg.metadata.src_node_id
    return nid - 1 if 1 <= nid <= n else None


def make_round_timer(cfg: RunConfig, *, server_link: Link | None = None) -> RoundTimer | None:
    """The ``sim_time(round, traffic)`` callback for ``cfg`` (None without devices)."""
    profiles = node_profiles(cfg)
    if profiles is None:
        return None
    entry = registry.get(cfg.strategy)
    if entry.kind == "decentralized":
        return _gossip_timer(cfg, profiles, registry.resolve_params(cfg.strategy, cfg.params))
    return _federated_timer(cfg, profiles, server_link)


def samples_of(cfg: RunConfig, msg: Message) -> float:
    """The examples a train reply's node computed on (its steps times the batch, else its epochs' examples)."""
    metrics = next(iter(msg.content.metric_records.values()), {})
    steps = metrics.get("steps")
    return (float(steps) * cfg.batch_size if steps is not None
            else float(metrics.get("num-examples", 0)) * cfg.local_epochs)


def make_node_timer(cfg: RunConfig) -> Callable[[Message, int, int], float | None] | None:
    """``node_time(reply, bytes_down, bytes_up)``: the simulated seconds one node's part of a federated
    round takes (download + compute + upload on its profile), None for a reply it cannot place; None
    without devices. A quorum round (:mod:`fedswarm.server.fleet_grid`) orders replies by it."""
    profiles = node_profiles(cfg)
    if profiles is None:
        return None
    n = len(profiles)

    def node_time(msg: Message, down: int, up: int) -> float | None:
        pid = None if msg.has_error() else _partition_of(msg, n)
        if pid is None or not 0 <= pid < n:
            return None
        return sync_round_time_s([profiles[pid]], [samples_of(cfg, msg)], [down], [up])

    return node_time


def _federated_timer(cfg: RunConfig, profiles: list[Profile], server_link: Link | None) -> RoundTimer:
    n = len(profiles)

    def sim_time(round: int, traffic: Traffic) -> float | None:
        nodes, samples, down, up = [], [], [], []
        for msg in traffic.replies:
            if msg.has_error():
                continue
            pid = _partition_of(msg, n)
            if pid is None or not 0 <= pid < n:
                continue
            nodes.append(profiles[pid])
            samples.append(samples_of(cfg, msg))
            nid = msg.metadata.src_node_id
            down.append(traffic.node_down.get(nid, 0))
            up.append(traffic.node_up.get(nid, 0))
        if not nodes:
            return None
        return sync_round_time_s(nodes, samples, down, up, server_link=server_link)

    return sim_time


def _gossip_timer(cfg: RunConfig, profiles: list[Profile], params: dict) -> RoundTimer:
    n = len(profiles)
    topology = make_topology(cfg.topology, n, cfg.seed)
    overlap = cfg.strategy == "dpsgd" and params.get("order") == "cta"
    samples = (cfg.local_steps or 1) * cfg.batch_size
    sizes = [model_message_nbytes(cfg)] * n  # updated from the messages actually sent

    def sim_time(round: int, traffic: Traffic) -> float:
        for msg in traffic.replies:
            if msg.has_error() or PAYLOAD_ARRAYS not in msg.content.array_records:
                continue
            pid = _partition_of(msg, n)
            if pid is not None and 0 <= pid < n:
                sizes[pid] = message_nbytes_of(msg.content.array_records[PAYLOAD_ARRAYS],
                                               msg.content.config_records[PAYLOAD_META])
        degrees = topology.degrees(round).tolist()
        return gossip_round_time_s(profiles, degrees, sizes, samples, overlap=overlap)

    return sim_time
