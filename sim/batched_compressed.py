"""The compressed strategies on the batched engine: ``compressed_fedavg`` (every codec),
``onebit`` and the robust rules, whose client half is
:func:`fedswarm.strategies.federated.compressed_fedavg.client_step`. ``gtopk`` runs on this
runner with its own client half (:mod:`fedswarm.sim.batched_gtopk`), the sketch strategies
too (:mod:`fedswarm.sim.batched_sketched`).

Server half: the strategy object itself, built as :func:`fedswarm.server.app.build_strategy`
builds it. Its ``plan_train`` (``configure_train``'s work with the messages unbuilt: a
:class:`~fedswarm.strategies.federated.compressed_base.TrainPlan`) samples the nodes, writes the
``compress`` knobs, one replica-sync body per version the nodes hold, each node's sync
bookkeeping and pending selection; a node's real train message is built only when read (its
bytes, a refused or failed reply, an attack). Once the clients are done, its ``apply_accepted``
aggregates (its own ``aggregate``: the weighted average, ``server_lr``, the downlink codec with
the server's residual) and commits the update to the public model.

Client half, on the client axis: the batched trainer trains every sampled client from the
public model (every replica equals it), ``delta = theta_k - x`` is ``[C, d]``, and the
strategy's own client step, the one a Flower client runs with C = 1, runs on that batch:
once for all the clients that share an uplink (codec, parameters and seed; codecs whose
randomness is per client have one seed per client,
:func:`~fedswarm.strategies.federated.compressed_fedavg.uplink_seed`), with their rows of the
error-feedback residuals. The server decodes the batched payload with the codec its meta
names (what ``parse_reply`` does with each client's) and hands the rows to the strategy as
its accepted replies.

Bytes (:meth:`CompressedRounds._measured`): a real train message and a real reply (the
client's own one-row payload, ``metrics``, ``node``) are built and serialized once per distinct
size key of the round, read back for every client as arrays over the cohort; traffic and node
rows are written in bulk (:func:`~fedswarm.sim.batched_round.add_clients`,
:func:`~fedswarm.sim.batched_round.cohort_rows`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Message, RecordDict

from fedswarm.algorithms.compression.codecs import decode_payload
from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState
from fedswarm.local import node_report, train_reply
from fedswarm.payload import Payload, PayloadError
from fedswarm.params import all_finite
from fedswarm.server.metered_grid import Traffic, serialized_size
from fedswarm.sim.batched_round import (NODE_ROWS_MAX, ClientRows, NodeIds, add_clients, cohort_rows, make_reply,
                                        reply_size, round_schedule, varint_lens)
from fedswarm.sim.batched_fleet import fleet_of
from fedswarm.sim.inprocess import client_error_reply
from fedswarm.strategies.federated.compressed_base import KNOBS, Accepted, TrainPlan
from fedswarm.strategies.federated.compressed_fedavg import Uplink, client_step, uplink_of
from fedswarm.wire import payload_to_records, vector_to_arrayrecord

__all__ = ["CompressedRounds", "OneRow", "client_payload", "sent_rows"]


@dataclass
class _Reply:
    """One client's reply this round: what it sends, its sizes, and what the server reads of it."""

    k: int  # position in the round's sample
    node_id: int
    payload: Payload | OneRow  # its one-client payload (built when read: :meth:`sent`)
    size_key: tuple  # what its payload's serialized size depends on (shapes, meta)
    n: int
    loss: float
    steps: int
    device_class: str
    policy_json: str
    value: torch.Tensor | None  # the decoded update
    up: int = 0
    down: int = 0
    rejected: str | None = None
    error: Message | None = None  # a client whose own code raised sends this instead
    finite: bool | None = None  # whether ``value`` is finite, when known (read for the whole chunk at once)

    def sent(self) -> Payload:
        """Its one-client payload."""
        return self.payload.get() if isinstance(self.payload, OneRow) else self.payload

    def content(self) -> RecordDict:
        """The reply's records, as :func:`~fedswarm.strategies.federated.compressed_base.finish` writes them."""
        return train_reply(payload_to_records(self.sent(), RecordDict()), self.n, self.loss, self.steps,
                           node_report(self.device_class, self.policy_json))


def _finite(value) -> bool:
    """Whether a parsed reply (a tensor, or a tuple of them such as gTop-k's indices and values) is finite."""
    if isinstance(value, (tuple, list)):
        return all(_finite(v) for v in value)
    return not isinstance(value, torch.Tensor) or not value.is_floating_point() or all_finite(value)


def client_payload(payload: Payload, row: int, seed: int) -> Payload:
    """Row ``row`` of a batched payload as the one-client payload that client sends
    (every payload array has the leading client axis; ``meta`` says ``K = 1`` and its seed)."""
    arrays = {k: v[row:row + 1] for k, v in payload.arrays.items()}
    return Payload(arrays=arrays, meta={**payload.meta, "K": 1, "seed": int(seed)})


class OneRow:
    """Row ``row`` of a batched payload, as the one-client payload :func:`client_payload`
    makes of it when :meth:`get` is called: most clients' payloads are never read one by one
    (their bytes are measured once per size class), so none is built for them."""

    __slots__ = ("payload", "row", "seed")

    def __init__(self, payload: Payload, row: int, seed: int):
        self.payload, self.row, self.seed = payload, row, seed

    def get(self) -> Payload:
        return client_payload(self.payload, self.row, self.seed)


def sent_rows(payload: Payload, seed: int) -> list[tuple[OneRow, tuple]]:
    """Each client's one-row payload of a batched ``payload`` (:class:`OneRow`: built when
    read), with what its serialized size depends on (its arrays' shapes and dtypes, meta, seed)."""
    shapes = tuple((k, (1, *v.shape[1:]), str(v.dtype)) for k, v in payload.arrays.items())
    meta = tuple(sorted((k, v) for k, v in payload.meta.items() if k not in ("K", "seed")))
    key = (shapes, meta, seed)
    k = next(iter(payload.arrays.values())).shape[0]
    return [(OneRow(payload, i, seed), key) for i in range(k)]


class CompressedRounds:
    """Rounds of a compressed strategy; ``model`` is the strategy's public model."""

    #: A sharded engine's worker (:mod:`fedswarm.sim.batched_ray_workers`) sets this: the runner is
    #: then the client half of its shard only. Each batched payload its clients send goes to
    #: ``capture.payload(payload, partition ids, seed)`` undecoded, and each client's figures to
    #: ``capture.reply(k, n, loss, steps)`` / ``capture.error(k, n, exc)`` instead of a reply (the
    #: driver decodes, measures and aggregates them).
    capture = None

    def __init__(self, run, model: torch.Tensor, notes=None):
        self.run = run
        cfg = run.cfg
        self.layout = run.trainer.layout
        self.strategy = run.strategy()
        self.strategy.bind_notes(notes)
        self.initial = model
        self.arrays = vector_to_arrayrecord(model)
        self.grid = NodeIds(cfg.clients)
        self._inner = NodeIds(cfg.clients)
        self.byzantine = None
        if cfg.byzantine:
            from fedswarm.server.byzantine import ByzantineGrid

            self.byzantine = ByzantineGrid(self._inner, cfg.attack, cfg.byzantine,
                                           seed=cfg.seed, layout=self.layout, on_attack=lambda nodes, spec: notes.note(
                                               byzantine_nodes=[str(n) for n in nodes], attack=spec))
        # partition id -> the client's error-feedback residual [d], zeros before its first round
        self.residuals = ClientRows(self.layout.d, cfg.clients)  # arrays: only the clients that have one
        self.secure = None  # --secagg (a linear codec): the round's sum computed directly
        if cfg.secagg:
            from fedswarm.sim.batched_secagg_codec import SecurePayloadRounds

            self.secure = SecurePayloadRounds(cfg)
        # --quorum, --over-select, --eligible, --availability: sim/batched_fleet.py
        self.fleet = fleet_of(run, self.strategy)

    @property
    def model(self) -> torch.Tensor:
        """The public model (the initial one until the strategy's first round)."""
        x = self.strategy.model
        return self.initial if x is None else x

    def round(self, server_round: int) -> tuple[dict, list[dict]]:
        if self.secure is not None:  # sim/batched_secagg_codec.py: the same steps, the protocol's outcome
            return self.secure.round(self, server_round)
        run, strategy = self.run, self.strategy
        # under the fleet options the strategy samples from the round's pool, as from the fleet grid
        fleet = self.fleet.start(server_round) if self.fleet is not None else None
        grid = self.grid if fleet is None else self.fleet
        # the strategy's configure_train with the messages unbuilt (each built when read)
        messages = strategy.plan_train(server_round, self.arrays, run.train_config, grid)
        node_ids = messages.node_ids
        sched, classes, pols = round_schedule(run.cfg, node_ids, run.train_config, run.n_examples, server_round)
        total = len(node_ids)
        if self.byzantine is not None and self.byzantine.attack.kind == "data":  # labelflip
            # the chosen nodes train on flipped labels; the record that tells them so is added
            # below the meter (as on the in-process grid), so it is not in the bytes
            bad = set(self.byzantine.byzantine)
            sched.flip_labels = torch.tensor([nid in bad for nid in node_ids], dtype=torch.bool)
        policy_json = {c: json.dumps(p, sort_keys=True) for c, p in zip(classes, pols)}
        x = self.model
        replies = self._train_replies(x, sched, messages, node_ids, classes, pols, policy_json, total)
        replies.sort(key=lambda r: r.k)
        if self.byzantine is not None:  # (under the fleet options, on every reply: as the fleet grid's inner grid)
            self._attack(messages, [r for r in replies if r.error is None])
        if fleet is not None:  # every sampled client trained; the strategy gets the replies the fleet keeps
            replies, lost, lost_down = self.fleet.kept_replies(replies, server_round, fleet[2])
        traffic = Traffic()
        good = [r for r in replies if r.error is None]
        up = np.fromiter((r.up for r in good), dtype=np.int64, count=len(good))
        down = np.fromiter((r.down for r in good), dtype=np.int64, count=len(good))
        good_ids = [r.node_id for r in good]
        add_clients(traffic, good_ids, up, down)  # the content replies' bytes at once
        node_rows: list[dict] | None = None
        row_of: dict[int, dict] = {}  # position in the sample -> its node row
        if total <= NODE_ROWS_MAX:  # rows in sample order, a failed node's where its reply is
            rows = iter(cohort_rows(good_ids, up, down, [r.n for r in good], [r.loss for r in good],
                                    [classes[r.k] for r in good], [pols[r.k] for r in good]))
            node_rows = []
            for r in replies:
                if r.error is None:
                    node_rows.append(row_of.setdefault(r.k, next(rows)))
                else:  # as the strategy's aggregate_train: a failed node, its replica maybe gone
                    self._failed(traffic, node_rows, r)
        else:
            for r in replies:
                if r.error is not None:
                    self._failed(traffic, None, r)
        accepted: list[Accepted] = []
        loss_sum = weight_sum = 0.0
        for r in good:
            strategy.sync.ack(r.node_id)  # a content reply: the client saved its replica
            strategy.pending.pop(r.node_id, None)  # ... and applied the selection it was sent
            if r.rejected is None and not (r.finite if r.finite is not None else _finite(r.value)):
                r.rejected = self._refuse(messages[r.k], r)
            if r.rejected is not None:
                if node_rows is not None:
                    row_of[r.k].update(status="rejected", reason=r.rejected)
                continue
            accepted.append(Accepted(r.node_id, None, float(r.n), r.value))
            loss_sum += r.n * r.loss
            weight_sum += r.n
        accepted.sort(key=lambda a: a.node_id)
        strategy.apply_accepted(server_round, accepted)
        self.arrays = strategy.model_arrays()
        run.meter.traffic = traffic
        row = {"train_loss": loss_sum / weight_sum if weight_sum else None, "num_clients": total}
        if fleet is not None:  # sent, never answered in time: their bytes down count
            traffic.bytes_down += lost_down
            row["num_clients"] = len(replies)
            node_rows = self.fleet.close(row, node_rows or [], fleet[1], fleet[2], lost)
        return row, node_rows or []

    def _train_replies(self, x: torch.Tensor, sched, messages: TrainPlan | list[Message], node_ids: list[int],
                       classes: list[str], pols: list[dict], policy_json: dict[str, str], total: int
                       ) -> list[_Reply]:
        """The round's clients trained from ``x`` and their client half run: each one's reply
        (in any order), its bytes measured (:meth:`_measured`, which a replacement calls too). The hook a
        sharded engine replaces
        (:mod:`fedswarm.sim.batched_ray`: the shards trained where their clients live)."""
        run, trainer, cfg = self.run, self.run.trainer, self.run.cfg
        replies: list[_Reply] = []
        for rows, new, loss, n in trainer.fit(x, sched, momentum=cfg.momentum, chunk_size=run.chunk_size,
                                              memory_budget=run.memory_budget, on_chunk=run.progress(total)):
            delta = new.cpu() - x
            pids = sched.partitions[rows].tolist()
            ks = list(range(rows.start, rows.stop))
            n_list, loss_list, steps_list = n.tolist(), loss.tolist(), sched.steps[rows].tolist()
            finite = torch.isfinite(new).all(dim=1).tolist()
            # the finite rows in one batch; a client whose local SGD diverged alone: its client
            # step may raise (the client fails) or send what the server refuses
            batches = [[j for j, ok in enumerate(finite) if ok]] + [[j] for j, ok in enumerate(finite) if not ok]
            for members in filter(None, batches):
                sub = delta if len(members) == len(ks) else delta[members]
                try:
                    decoded, sent = self._client_step(sub, [pids[j] for j in members],
                                                      _configs(messages, [ks[j] for j in members]),
                                                      [pols[ks[j]] for j in members])
                except Exception as exc:
                    if finite[members[0]]:
                        raise
                    replies.append(self._error_reply(messages, node_ids, classes, ks[members[0]],
                                                     n_list[members[0]], exc))
                    continue
                # the server's finiteness check of every decoded update at once (a tensor of rows; else per reply)
                ok = torch.isfinite(decoded).all(dim=1).tolist() if isinstance(decoded, torch.Tensor) else None
                for i, j in enumerate(members):
                    reply = self._reply(messages, node_ids, classes, policy_json, ks[j], sent[i], n_list[j],
                                        loss_list[j], steps_list[j], decoded[i])
                    if ok is not None and isinstance(reply, _Reply):  # (a Ray worker's _reply returns its own record)
                        reply.finite = ok[i]
                    replies.append(reply)
        return self._measured(messages, replies)

    def _reply(self, messages: list[Message], node_ids: list[int], classes: list[str], policy_json: dict[str, str],
               k: int, sent: tuple[Payload, tuple], n: int, loss: float, steps: int, value) -> _Reply:
        """Client ``k``'s reply: its one-row payload and size key ``sent``, what the server
        reads of it (``value``); its bytes are measured with the round's (:meth:`_measured`)."""
        if self.capture is not None:
            return self.capture.reply(k, n, loss, steps)
        return _Reply(k, node_ids[k], sent[0], sent[1], n, loss, steps, classes[k], policy_json[classes[k]], value)

    def _error_reply(self, messages: list[Message], node_ids: list[int], classes: list[str], k: int, n: int,
                     exc: BaseException) -> _Reply:
        """Client ``k``'s error reply: its own code raised ``exc``."""
        if self.capture is not None:
            return self.capture.error(k, n, exc)
        r = _Reply(k, node_ids[k], None, (), n, float("nan"), 0, classes[k], "", None,
                   error=client_error_reply(messages[k], exc))
        r.up = serialized_size(r.error)  # its message's bytes: with the round's (:meth:`_measured`)
        return r

    # -- replies the server does not aggregate -----------------------------------------------
    def _failed(self, traffic: Traffic, node_rows: list[dict] | None, r: _Reply) -> None:
        """A client whose code raised: its error reply counted and its row marked as the
        recorder marks one (no class, loss or examples), and the server forgets its replica."""
        traffic.bytes_down += r.down
        traffic.bytes_up += r.up
        traffic.node_down[r.node_id] += r.down
        traffic.node_up[r.node_id] += r.up
        if node_rows is not None:
            node_rows.append({"node_id": str(r.node_id), "bytes_up": r.up, "bytes_down": r.down, "status": "failed",
                              "reason": r.error.error.reason[:2000]})
        self.strategy.sync.forget(r.node_id)

    def _refuse(self, ins: Message, r: _Reply) -> str:
        """A reply whose update decodes to non-finite values (a diverged client's), read as the
        server reads it (the strategy's ``parse_reply``) and refused with its reason."""
        msg = make_reply(ins, r.content())
        try:
            self.strategy.parse_reply(msg)
            reason = "payload decodes to non-finite values"  # not reached: parse_reply checks it
        except (PayloadError, KeyError, TypeError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
        return self.strategy.reject(msg, reason)

    # -- Byzantine clients (--byzantine): the attack of fedswarm.server.byzantine, unchanged --
    def _attack(self, messages: list[Message], replies: list[_Reply]) -> None:
        """Pass the round's real replies through :class:`~fedswarm.server.byzantine.ByzantineGrid`
        (which rewrites the chosen nodes' replies, as between the in-process grid and the
        meter), then read each attacked reply as the server does (the strategy's
        ``parse_reply``; a reply it refuses is rejected) and measure it again."""
        msgs = [make_reply(messages[r.k], r.content()) for r in replies]
        bad = set(self.byzantine.byzantine)
        self._inner.replies = msgs
        self.byzantine.send_and_receive(messages)
        for r, msg in zip(replies, msgs):
            if r.node_id not in bad:
                continue
            r.up = serialized_size(msg)
            r.finite = None  # its value is the attacked one's: checked again
            try:
                r.value = self.strategy.parse_reply(msg)
            except (PayloadError, KeyError, TypeError, ValueError) as exc:
                r.rejected = self.strategy.reject(msg, str(exc) or type(exc).__name__)

    # -- the clients' half, on the client axis --------------------------------------------
    def _client_step(self, delta: torch.Tensor, pids: list[int], ins: list[Message],
                     policies: list[dict]) -> tuple[list | torch.Tensor, list[tuple[Payload, tuple]]]:
        """The clients' half after local training, for a chunk: ``delta`` ``[C, d]``, their
        partition ids, train messages and device-class policies; returns what the server's
        ``parse_reply`` makes of each reply and each client's one-row payload with its size key.

        Here :func:`~fedswarm.strategies.federated.compressed_fedavg.client_step` once for
        the clients of each uplink (codec, parameters and seed), with their residuals."""
        knobs = ins[0].content.config_records[KNOBS]
        seed = self.run.cfg.seed
        decoded = torch.empty_like(delta)
        sent: list[tuple[Payload, tuple] | None] = [None] * len(pids)
        groups: dict[Uplink, list[int]] = defaultdict(list)
        shared: dict[int, Uplink | None] = {}  # id(policy) -> its clients' one uplink (None: a seed per client)
        for j, (pid, policy) in enumerate(zip(pids, policies)):
            if id(policy) not in shared:  # the clients of one device class share its policy object
                first = uplink_of(knobs, policy, seed, 0)
                shared[id(policy)] = first if uplink_of(knobs, policy, seed, 1) == first else None
            uplink = shared[id(policy)]
            groups[uplink if uplink is not None else uplink_of(knobs, policy, seed, pid)].append(j)
        for uplink, members in groups.items():
            idx = torch.tensor(members)
            state = ErrorFeedbackState()
            if uplink.error_feedback:
                state = ErrorFeedbackState(self.residuals.stack([pids[j] for j in members]))
            payload, state = client_step(uplink, state, delta[idx], self.layout)
            if uplink.error_feedback:
                self.residuals.keep_stacked([pids[j] for j in members], state.residual)
            if self.capture is not None:
                self.capture.payload(payload, [pids[j] for j in members], uplink.seed)
                continue
            self._decode(payload, members, uplink.seed, decoded)
            for j, row in zip(members, sent_rows(payload, uplink.seed)):
                sent[j] = row
        return decoded, sent  # type: ignore[return-value]

    def _decode(self, payload: Payload, members: list[int], seed: int, out: torch.Tensor) -> None:
        """The server's reading of the payload of the clients ``members`` into their rows of
        ``out`` (what ``parse_reply`` decodes of each; NaN where it refuses a client's)."""
        lo, hi = members[0], members[0] + len(members)
        view = out[lo:hi]
        try:
            if members == list(range(lo, hi)) and view.dtype == torch.float32 and view.is_contiguous():
                decode_payload(payload, self.layout, out=view)  # straight into the round's buffer
            else:
                out[torch.tensor(members)] = decode_payload(payload, self.layout)
        except PayloadError:  # the server's reading of some client's payload fails: client by client
            for i, j in enumerate(members):
                try:
                    out[j] = decode_payload(client_payload(payload, i, seed), self.layout)[0]
                except PayloadError:
                    out[j] = float("nan")  # refused by the strategy's parse_reply in round()

    # -- bytes ---------------------------------------------------------------------------------
    def _measured(self, messages: TrainPlan | list[Message], replies: list[_Reply]) -> list[_Reply]:
        """``replies`` with their bytes: every train message's and every content reply's size,
        measured on a real message once per distinct size key of the round and read back by
        the key's index (an error reply's own size is its own: :meth:`_error_reply`).
        The train message's body depends on the version its node holds and a pending selection
        (its round, kind and length), its metadata on the node id's length; a reply on its
        payload's size key, examples, steps, class, policy and the node id's length."""
        if self.capture is not None or not replies:  # a shard worker's records: the driver measures
            return replies
        ks = np.fromiter((r.k for r in replies), dtype=np.int64, count=len(replies))
        ids = np.fromiter((r.node_id for r in replies), dtype=np.int64, count=len(replies))
        lens = varint_lens(ids)
        if isinstance(messages, TrainPlan):
            bases, pending, fresh = messages.bases, messages.pending, messages.fresh
        else:  # a list of built messages (a secure round's cohort): each one's state, as planned
            nodes = self.strategy.sync.nodes
            bases = [nodes.get(m.metadata.dst_node_id) for m in messages]
            pending, fresh = self.strategy.pending, messages.__getitem__
        codes: dict = {}
        body = np.fromiter((codes.setdefault(bases[k], len(codes)) for k in ks.tolist()), dtype=np.int64,
                           count=len(ks))
        sels: dict = {None: 0}
        sel = np.fromiter((sels.setdefault(None if p is None else (p[0], p[1], len(p[2])), len(sels))
                           for p in map(pending.get, ids.tolist())), dtype=np.int64, count=len(ids)) \
            if pending else np.zeros(len(ids), dtype=np.int64)
        down = _by_key(np.stack([body, sel, lens], axis=1),
                       lambda i: serialized_size(fresh(int(ks[i]))))  # each measured before any reply's id
        content = [i for i, r in enumerate(replies) if r.error is None]
        up = np.zeros(len(replies), dtype=np.int64)
        if content:
            keys: dict = {}
            strings: dict = {}
            cols = np.array([(keys.setdefault(r.size_key, len(keys)), r.n, r.steps,
                              strings.setdefault((r.device_class, r.policy_json), len(strings)))
                             for r in (replies[i] for i in content)], dtype=np.int64).reshape(-1, 4)
            sub = np.asarray(content, dtype=np.int64)
            up[sub] = _by_key(np.concatenate([cols, lens[sub, None]], axis=1),
                              lambda i: reply_size(messages[int(ks[sub[i]])], replies[int(sub[i])].content()))
        for r, d, u in zip(replies, down.tolist(), up.tolist()):
            r.down = d
            if r.error is None:
                r.up = u
        return replies


def _by_key(keys: np.ndarray, measure) -> np.ndarray:
    """``measure(i)`` once per distinct row of ``keys`` ``[K, m]`` (at its first row ``i``), read
    back for every row: an int64 array ``[K]``."""
    spans = keys.max(axis=0, initial=0) + 1 if keys.min(initial=0) >= 0 else None
    if spans is not None and float(np.prod(spans.astype(np.float64))) < 2.0**62:  # one int64 key a row
        flat = np.zeros(len(keys), dtype=np.int64)
        for col, span in zip(keys.T, spans.tolist()):
            flat = flat * span + col
        _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    sizes = np.fromiter((measure(int(i)) for i in first.tolist()), dtype=np.int64, count=len(first))
    return sizes[inverse.reshape(-1)]


class _Configs:
    """What the client step reads of a train message (its config records), without the message."""

    __slots__ = ("config_records",)

    def __init__(self, records: dict):
        self.config_records = records

    @property
    def content(self) -> _Configs:
        return self


def _configs(messages: TrainPlan | list, ks: list[int]) -> list:
    """The train messages ``ks`` as the client step reads them: a :class:`TrainPlan`'s config
    records (no message built), else the messages themselves."""
    if isinstance(messages, TrainPlan):
        return [_Configs(messages.config_records(k)) for k in ks]
    return [messages[k] for k in ks]
