"""Draco and Solon as Flower strategies: redundant data assignment, coded replies, and the
exact sum decoded despite up to s liars.

Every round all P nodes train. The server numbers the nodes 0..P-1 (sorted node ids, once)
and tells each its worker index; worker i holds the r partitions ``A_i`` of the code
(:mod:`fedswarm.algorithms.robust.coding`: cyclic ``i..i+r−1`` for Solon and Draco's
cyclic code, groups of 2s+1 for Draco's repetition code). For each partition j it holds
it runs local SGD from the public model *with partition j's seed* — every holder of j
computes the same update ``g_j`` — and sends one coded message: d floats for Draco,
⌈d/m⌉ for Solon. The server decodes ``Σ_j g_j`` (locating and dropping liars), and::

    x̂ ← x̂ + server_lr · (1/P) Σ_j g_j

which is FedAvg over the P partitions with equal weights, whatever up to s workers send.
A round that cannot be decoded (more liars than the code corrects) leaves the model as
it was, and says so in the round's row (``decode_failed``).

Computation: r local trainings per worker (reported as r × the steps, so the time model
charges it). Wire: the coded payload up, the model or its changed coordinates down.
State: the code and the node numbering on the server; none on the clients.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import log

from fedswarm.algorithms.robust.aggregators import ToleranceError
from fedswarm.algorithms.robust.coding import make_code
from fedswarm.errors import ConfigError
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.local import LocalFit, prepare_local
from fedswarm.params import ParamLayout
from fedswarm.payload import Payload, PayloadError
from fedswarm.strategies.federated.compressed_base import (Accepted, CompressedStrategy, Step, begin, finish,
                                                           read_payload)
from fedswarm.strategies.registry import BuildContext, StrategyEntry, register
from fedswarm.strategies.strategy_utils import NODE_WAIT_S, wait_for_nodes
from fedswarm.train import TrainResult
from fedswarm.wire import payload_to_records, vector_to_arrayrecord

__all__ = ["CodedStrategy", "coded_client_update"]

CODE = "code"  # the ConfigRecord with a node's worker index


@functools.lru_cache(maxsize=32)
def _code(scheme: str, P: int, s: int, m: int):
    return make_code(scheme, P, s, m)


class CodedStrategy(CompressedStrategy):
    """Exact Byzantine-resilient aggregation by a gradient code (Draco, Solon).

    Parameters
    ----------
    layout : ParamLayout
    num_workers : int
        P, the nodes of the federation (all train every round).
    s : int
        Liars the code corrects.
    scheme : str
        ``solon`` (polynomial code with compression m), ``repetition`` or ``cyclic``
        (Draco), ``auto`` (Draco: repetition when 2s+1 divides P, else cyclic).
    m : int (default: 3)
        Solon's communication compression (messages of ⌈d/m⌉ floats, r = 2s + m).
    server_lr, seed, history
        See :class:`~fedswarm.strategies.federated.compressed_base.CompressedStrategy`.
    """

    state_attrs = CompressedStrategy.state_attrs + ("workers", "_rng")  # worker map, decoder projections

    def rename_nodes(self, moved: dict[int, int]) -> None:
        """Resumed: a worker that restored its state under a new node id keeps its index."""
        self.workers = {moved.get(nid, nid): i for nid, i in self.workers.items()}

    def __init__(self, layout: ParamLayout, num_workers: int, s: int, *, scheme: str = "solon", m: int = 3,
                 name: str = "solon", **kwargs: Any):
        super().__init__(layout, min_available_nodes=num_workers, min_train_nodes=num_workers, **kwargs)
        self.name = name
        self.code = _code(scheme, int(num_workers), int(s), int(m) if scheme == "solon" else 1)
        self.P, self.s = int(num_workers), int(s)
        self.workers: dict[int, int] = {}  # node id -> worker index
        self._rng = np.random.default_rng(self.seed * 15_485_863 + 1)  # the decoder's secret projections

    def summary_lines(self) -> list[str]:
        return [self.code.summary(), f"message: {self.code.message_size(self.layout.d)} floats of d={self.layout.d}"]

    def knobs(self, server_round: int) -> dict[str, Any]:
        return {"scheme": self.code.scheme, "P": self.P, "s": self.s, "m": self.code.m,
                "code": self._scheme_name()}

    def _scheme_name(self) -> str:
        return "repetition" if self.code.scheme == "repetition" else ("solon" if self.code.m > 1 else "cyclic")

    def configure_train(self, server_round, arrays, config, grid) -> Iterable[Message]:
        if not self.workers:
            nodes = wait_for_nodes(grid, self.P, NODE_WAIT_S)
            if len(nodes) != self.P:
                raise ConfigError(f"{self.name} is built for P={self.P} workers, the federation has {len(nodes)} nodes")
            self.workers = {nid: i for i, nid in enumerate(nodes)}
        else:
            self._adopt_new_nodes(grid)
        messages = []
        for msg in super().configure_train(server_round, arrays, config, grid):
            worker = self.workers.get(msg.metadata.dst_node_id)
            if worker is None:  # a spare node: every worker index is held by a connected node
                continue
            msg.content[CODE] = ConfigRecord({"worker": worker})
            messages.append(msg)
        return messages

    def _adopt_new_nodes(self, grid) -> None:
        """A worker whose node left (a SuperNode restarted gets a new node id, and one that
        restored no state is not renamed by :meth:`rename_nodes`): its index goes to a node
        that is not a worker yet, lowest ids first, and the round's row names the change.
        The worker's data partitions are fixed by its index, and its update depends only on
        the public model, so the new node computes exactly what the old one would have; a
        new node with no free index sits out until one frees up."""
        present = {int(n) for n in grid.get_node_ids()}
        free = sorted((i, nid) for nid, i in self.workers.items() if nid not in present)
        new = sorted(n for n in present if n not in self.workers)
        moved = []
        for (i, old), nid in zip(free, new):
            del self.workers[old]
            self.workers[nid] = i
            moved.append({"worker": i, "from": old, "to": nid})
            log(WARNING, "%s: worker %d was node %s, which left; node %s takes it over", self.name, i, old, nid)
        if moved:
            self.note(workers_reassigned=moved)

    def parse_reply(self, msg: Message) -> torch.Tensor:
        payload = read_payload(msg, self.layout.d)
        z = payload.arrays.get("z")
        ell = self.code.message_size(self.layout.d)
        if z is None or np.asarray(z).shape != (ell,) or np.asarray(z).dtype != np.float32:
            raise PayloadError(f"a {self.name} reply carries 'z', float32 of shape ({ell},)")
        if msg.metadata.src_node_id not in self.workers:
            raise PayloadError(f"node {msg.metadata.src_node_id} is not a worker of this code")
        return torch.from_numpy(np.asarray(z, dtype=np.float32).copy())

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step | None:
        t0 = time.perf_counter()
        ell = self.code.message_size(self.layout.d)
        Z = np.zeros((self.P, ell))
        present = np.zeros(self.P, bool)
        for a in accepted:
            i = self.workers[a.node_id]
            Z[i], present[i] = a.value.numpy(), True
        res = self.code.decode(Z, self.layout.d, present, rng=self._rng)
        index_to_node = {i: nid for nid, i in self.workers.items()}
        decode_s = time.perf_counter() - t0
        if not res.ok:
            log(WARNING, "round %s: %s could not decode: %s", server_round, self.name, res.message)
            self.note(decode_failed=res.message, decode_s=decode_s)
            return None
        self.note(liars_located=[index_to_node[i] for i in res.liars], decode_s=decode_s)
        u = torch.from_numpy(res.total / self.P).to(torch.float32)
        return Step(u if self.server_lr == 1.0 else u * self.server_lr, metrics={"liars_located": len(res.liars)})


def coded_client_update(msg: Message, context: Context) -> RecordDict:
    """Train on each of this worker's r partitions (each with its own seed) from the
    public model, encode, reply with the coded message."""
    cr = begin(msg, context)
    code_rec = msg.content.config_records.get(CODE)
    if code_rec is None:
        raise PayloadError(f"train message has no '{CODE}' record (the worker index)")
    knobs = cr.knobs
    P, s, m = int(knobs["P"]), int(knobs["s"]), int(knobs["m"])
    code = _code(str(knobs["code"]), P, s, m)
    worker = int(code_rec["worker"])
    if not 0 <= worker < P:
        raise PayloadError(f"worker index {worker} outside 0..{P - 1}")
    view = _View(RecordDict({"arrays": vector_to_arrayrecord(cr.model), "config": msg.content.config_records["config"],
                             **({"byzantine": msg.content.config_records["byzantine"]}
                                if "byzantine" in msg.content.config_records else {})}))
    updates, losses, steps, examples, setup = [], [], 0, 0, None
    for j in code.assignment[worker]:
        setup = prepare_local(view, context, vector=cr.model, partition=j)
        res = setup.trainer.fit(setup.start, **setup.fit_kwargs)
        updates.append((res.flat - setup.start).double().numpy())
        losses.append(res.loss)
        steps += res.steps
        examples += res.num_examples
    z = code.encode(worker, np.stack(updates)).astype(np.float32)
    payload = Payload({"z": z}, {"scheme": code.scheme, "worker": worker, "round": cr.round})
    # r trainings: the reply's steps are r times a plain client's, so the time model charges them
    result = TrainResult(cr.model, float(np.mean(losses)), examples, steps)
    fit = LocalFit(setup.cfg, setup.trainer, cr.model, result, setup.device_class, setup.policy)
    reply = finish(cr, fit, payload_to_records(payload, RecordDict()), partitions=len(updates))
    reply["metrics"]["partition-id"] = int(context.node_config.get("partition-id", -1))
    return reply


class _View:
    def __init__(self, content: RecordDict):
        self.content = content


def _build(scheme_default: str, name: str):
    def build(params: dict, ctx: BuildContext) -> CodedStrategy:
        cfg = ctx.config
        if cfg.fraction != 1.0:
            raise ConfigError(f"{name} trains every worker every round: fraction must be 1 (got {cfg.fraction})")
        s = cfg.byzantine if params["s"] < 0 else params["s"]
        scheme = scheme_default if name == "solon" else params["code"]
        try:
            strategy = CodedStrategy(ctx.layout, cfg.clients, s, scheme=scheme, m=params.get("m", 1), name=name,
                                     server_lr=params["server_lr"], seed=cfg.seed)
        except ToleranceError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        m = params.get("m", 1) if name == "solon" else 1
        if 2 * cfg.byzantine + m > cfg.clients:
            raise ConfigError(f"{name}: {cfg.byzantine} Byzantine of {cfg.clients} clients is past what any such code "
                              f"corrects (P >= 2s + m = {2 * cfg.byzantine + m})")
        if cfg.byzantine > s:  # allowed on purpose: the rounds then say they could not be decoded
            log(WARNING, "%s corrects s=%d liars and the run has %d: rounds it cannot decode leave the model "
                "as it was", name, s, cfg.byzantine)
        return strategy
    return build


# s = -1 stands for the run's --byzantine, which the builder puts in its place; the constructor's s
# has no default, so it is written here.
_S = HyperParam("s", -1, "liars the code corrects (-1: the run's --byzantine)", ge=-1, le=100_000)
_LR = HyperParam("server_lr", SIGNATURE, "scale of the decoded average update", gt=0.0, le=100.0)

register(StrategyEntry(
    name="solon",
    description="Solon-style coded aggregation: each client trains r = 2s+m partitions, sends d/m coded floats; "
                "the exact average is decoded despite s liars.",
    build=_build("solon", "solon"),
    hyperparams=defaults_from(CodedStrategy, (_S, HyperParam("m", SIGNATURE, "communication compression: messages "
                                                             "of d/m floats (r = 2s + m)", ge=1, le=1_000), _LR)),
    client_update=coded_client_update,
    paper="L. Chen, L. Chen, Wang, Davidson, Dobriban, arXiv 2110.01595 (2021) [construction reconstructed]",
))

register(StrategyEntry(
    name="draco",
    description="Draco: each client trains r = 2s+1 partitions and sends d floats; majority vote (repetition code) "
                "or cyclic-code decoding recovers the exact average despite s liars.",
    build=_build("auto", "draco"),
    hyperparams=defaults_from(CodedStrategy, (_S, HyperParam("code", "auto", "repetition (needs 2s+1 | P), cyclic, "
                                                             "or auto", choices=("auto", "repetition", "cyclic")),
                                              _LR)),  # code: Draco's scheme (the constructor's defaults to solon)
    client_update=coded_client_update,
    paper="Chen, Wang, Charles, Papailiopoulos, ICML 2018",
))
