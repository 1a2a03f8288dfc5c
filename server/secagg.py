"""Secure aggregation for any fedswarm strategy whose aggregate is a weighted mean of the
nodes' models: :class:`SecAggGrid`, a Grid wrapper that turns each train round into a
SecAgg+ round (:mod:`fedswarm.algorithms.secagg`) with the nodes' ``secagg_mod``.

Where it sits: ``strategy -> SecAggGrid -> MeteredGrid -> engine grid``. The strategy sends its
round's train messages as always; the wrapper does not forward them. It runs the protocol's
four stages with the nodes instead, each stage one Flower message per node of the train
messages' own type (so every stage's bytes are metered, and a node's ClientApp dispatches it
to the handler the mod wraps); the third stage carries the train message's content, so the
node trains on it as it would have. From the unmasked sum it hands the strategy ONE reply in
the name of the round's first node: ``arrays`` = the global model plus the weighted mean of the
nodes' (clipped, quantized) updates, ``num-examples`` = the nodes' total weight. A weighted mean
of that one reply (FedAvg's) is the round's true weighted mean. The server learns the sum and
the total weight, never one node's update or count.
``loss=True`` (fedswarm's ServerApp, unless ``--dp``): the round's vector is one value longer and
each node puts its train loss there (:func:`~fedswarm.algorithms.secagg.quantize.with_loss`), so
the server learns the survivors' weighted mean train loss (within quantization error), never
one node's: the one reply's ``train_loss`` metric, and ``on_round(train_loss=...)``.

A round that cannot finish (too few nodes or shares past the threshold) hands the strategy no
reply: the model stays as it was, the round's row says why (``secagg_failed``), and the run
goes on. ``dropout`` (run config ``secagg_dropout``): each node vanishes with that probability at
one stage (:func:`fedswarm.algorithms.secagg.dropouts.draw_dropouts`, from the run's seed and the
round, as the batched engine draws them): its replies from that stage on are discarded, simulated
dropouts that exercise recovery on every engine. Each round's row gets, under ``secagg``:
participants, nodes at each stage, dropped after sharing, recovered, threshold, degree, field
bits, bytes down/up per stage, and any corrupt shares the server caught and worked around
(``bad_shares``, :mod:`fedswarm.algorithms.secagg.server`). A codec strategy's train messages carry no model: its nodes
mask their payload (:mod:`fedswarm.strategies.secagg_payload`) and the one reply carries the
weighted mean payload.

Flower users get the same with their own Message-API strategy: wrap the grid their
``ServerApp`` receives, ``strategy.start(grid=SecAggGrid(grid, SecAggParams(...)), ...)``, and
add ``fedswarm.client.secagg_mod`` to their ClientApp.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedswarm.algorithms.secagg.dropouts import draw_dropouts
from fedswarm.algorithms.secagg import STAGES, SecAggFailed, SecAggParams, SecAggServer
from fedswarm.algorithms.secagg.quantize import split_loss
from fedswarm.errors import ConfigError
from fedswarm.server.secagg_dp import SecAggDP, check_distributed_dp
from fedswarm.strategies import registry
from fedswarm.server.metered_grid import WrappingGrid, serialized_size
from fedswarm.strategies.secagg_payload import SPEC_RECORD, check_specs, payload_dim, payload_reply, sum_metrics
from fedswarm.strategies.secagg_records import (RECORD, encode_request, keys_from, masked_from, shares_from,
                                                unmask_from)
from fedswarm.wire import array_keys, arrayrecord_to_vector, vector_to_arrays_like

log = logging.getLogger("fedswarm.server")

__all__ = ["SecAggGrid", "check_secagg", "is_train", "secagg_params"]


def is_train(msg: Message) -> bool:
    t = msg.metadata.message_type
    return t == "train" or t.startswith("train.")


class SecAggGrid(WrappingGrid):
    """Runs every train round over ``inner`` as a SecAgg+ round (see the module docstring).
    ``on_round(metrics)`` receives each round's figures (fedswarm's recorder: ``note``)."""

    def __init__(self, inner: Grid, params: SecAggParams, *, dropout: float = 0.0, seed: int = 0,
                 on_round: Callable[..., Any] | None = None, dp: SecAggDP | None = None,
                 dim_of: Callable[[], int | None] | None = None, loss: bool = False):
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"secagg dropout must be in [0, 1), got {dropout}")
        if loss and dp is not None:
            raise ValueError("SecAggGrid: loss=True under distributed DP: the noise covers the update, not the loss")
        super().__init__(inner)
        self.params, self.dropout, self.seed, self.on_round = params, float(dropout), int(seed), on_round
        self.dp = dp  # distributed DP (--dp): the round's noise room and the accountant (server/secagg_dp.py)
        # A codec strategy's payload length (its ``secagg_dim``): train messages without the model
        self.dim_of = dim_of
        self.loss = bool(loss)  # the nodes append their train loss to the masked vector
        self.rounds = 0
        self.survivors: list[int] = []  # the nodes in the last secure round's sum
        self.note_key = "secagg"  # the round row's key for this sum's figures (second_sum changes it)
        self._rng = np.random.default_rng([self.seed, 0x5EC])

    # -- Grid: messages --------------------------------------------------------------------
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        if any(is_train(m) for m in msgs):
            raise RuntimeError("SecAggGrid runs train rounds through send_and_receive only: a train message "
                               "pushed on its own would reach the node in the clear")
        return self.inner.push_messages(msgs)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        train = [m for m in msgs if is_train(m)]
        if not train:
            return self.inner.send_and_receive(msgs, timeout=timeout)
        if len(train) != len(msgs):
            raise RuntimeError("SecAggGrid: a round mixes train and other messages; send them apart")
        return self._secure_round(train, timeout)

    @contextmanager
    def second_sum(self, name: str):
        """A strategy's second secure sum in its round (Sketched-SGD's exact values): no train
        loss in its vector, and its figures on the round's row as ``secagg_<name>``, next to the
        first sum's ``secagg`` (the epsilon recorded is the run's after both releases)."""
        saved = self.loss, self.note_key
        self.loss, self.note_key = False, f"secagg_{name}"
        try:
            yield self
        finally:
            self.loss, self.note_key = saved

    # -- one round -------------------------------------------------------------------------
    def _secure_round(self, train: list[Message], timeout: float | None) -> list[Message]:
        self.rounds += 1
        self.survivors = []
        by_node = {int(m.metadata.dst_node_id): m for m in train}
        first = train[0]
        if "arrays" in first.content.array_records:
            model = arrayrecord_to_vector(first.content.array_records["arrays"]).numpy()  # float32; + a float64 mean
            dim = model.size
        elif (dim := (self.dim_of() if self.dim_of is not None else None) or payload_dim(first)) is not None:
            # a codec strategy: the nodes mask their payloads
            model = None
        else:
            raise RuntimeError("SecAggGrid: a train message must carry the global model as 'arrays', or the grid "
                               "needs the payload's length (dim_of: the strategy's secagg_dim; a sketch strategy's "
                               "knobs rows, cols, hash_seed)")
        mtype, group = first.metadata.message_type, first.metadata.group_id
        params = self.params if self.dp is None else self.dp.round_params(self.params, len(by_node), dim)
        srv = SecAggServer(sorted(by_node), dim + (1 if self.loss else 0), params,
                           graph_seed=int(self._rng.integers(1 << 62)))
        # simulated dropouts: the drawn nodes' replies are lost from their stage on (every engine draws them so)
        gone = draw_dropouts(sorted(by_node), self.dropout, self.seed, self.rounds) if self.dropout else {}
        figures: dict[str, Any] = {"bytes": {}, "nodes": {}, "refused": {}}
        inputs: dict[int, np.ndarray] = {}
        specs: dict[int, Any] = {}

        def exchange(stage: str, requests: dict[int, Any], extra: Callable[[int], RecordDict] | None = None):
            out = []
            for node, req in requests.items():
                content = RecordDict(dict(extra(node).items())) if extra is not None else RecordDict()
                content[RECORD] = encode_request(req)
                out.append(self.inner.create_message(content, mtype, node, group))
            cache: dict[int, int] = {}
            down = sum(serialized_size(m, cache) for m in out)  # as the meter counts them: before they go
            replies = list(self.inner.send_and_receive(out, timeout=timeout))
            figures["bytes"][stage] = {"down": down, "up": sum(serialized_size(r) for r in replies)}
            # A reply belongs to the node its message went to (the grid set the messages' ids as it pushed
            # them): the SuperLink answers for an unreachable node from its own id (1).
            asked = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in out}
            got = {}
            for r in replies:
                node = asked.get(r.metadata.reply_to_message_id, int(r.metadata.src_node_id))
                if r.has_error():
                    figures["refused"][str(node)] = r.error.reason.strip().split("\n")[0][:300]
                elif int(r.metadata.src_node_id) != node:
                    figures["refused"][str(node)] = f"a reply from node {r.metadata.src_node_id} to its message"
                elif node in requests and node not in gone.get(stage, ()):
                    got[node] = r.content
            figures["nodes"][stage] = len(got)
            return got

        try:
            try:
                keys = {n: keys_from(c) for n, c in exchange(STAGES[0], srv.setup()).items()}
                shares = {n: shares_from(c) for n, c in exchange(STAGES[1], srv.collect_keys(keys)).items()}
                masked = exchange(STAGES[2], srv.collect_shares(shares), extra=lambda n: by_node[n].content)
                inputs = {n: masked_from(c) for n, c in masked.items()}
                specs = {n: c.config_records.get(SPEC_RECORD) for n, c in masked.items()}
                answers = {n: unmask_from(c) for n, c in exchange(STAGES[3], srv.collect_masked(inputs)).items()}
                total = srv.collect_unmask(answers)
                decoded = srv.quantizer.decode_sum(total)
                spec = None if model is not None else check_specs({n: specs[n] for n in inputs}, dim)
            except (KeyError, ValueError) as exc:  # a malformed reply or sum: the round cannot finish
                raise SecAggFailed(f"{type(exc).__name__}: {exc} (answers per stage {figures['nodes']}, "
                                   f"survivors {sorted(inputs)}, refused {figures['refused']})", "unmask") from None
        except SecAggFailed as exc:
            log.warning("secure aggregation round %d failed: %s", self.rounds, exc)
            self._note(srv, figures, failed=str(exc))
            return []
        mean, loss = split_loss(decoded.mean, params.clip) if self.loss else (decoded.mean, None)
        self._note(srv, figures, dp=None if self.dp is None else self.dp.account(srv.report.masked),
                   train_loss=loss)
        self.survivors = sorted(inputs)  # who is in the sum (the server learns it): a second exchange asks them
        survivor = min(inputs)  # the reply goes in the name of a node that took part
        if model is None:  # the weighted mean payload: the strategy decodes it as it decodes a plain one
            content = payload_reply(mean, spec)
        else:
            new = model + mean
            arrays = vector_to_arrays_like(new.astype(np.float32), array_keys(first.content.array_records["arrays"]))
            content = RecordDict({"arrays": arrays})
        content["metrics"] = sum_metrics(decoded.total_weight, loss)
        reply = Message(content, reply_to=by_node[survivor])
        return [reply]

    def _note(self, srv: SecAggServer, figures: dict, failed: str | None = None, dp: dict | None = None,
              train_loss: float | None = None) -> None:
        r = srv.report
        row = {"participants": r.participants, "nodes": figures["nodes"], "bytes": figures["bytes"],
               "dropped_after_sharing": r.dropped_after_sharing, "recovered": r.recovered,
               "threshold": r.threshold, "degree": r.degree, "field_bits": r.field_bits,
               "refused": figures["refused"]}
        if r.bad_shares:  # corrupt shares caught at unmasking ("holder>owner:seed|key"); the round used others
            row["bad_shares"] = list(r.bad_shares)
            log.warning("secure aggregation round %d: corrupt shares %s", self.rounds, ", ".join(r.bad_shares))
        if failed is not None:
            row["failed"] = failed
        if self.on_round is not None:
            self.on_round(**{self.note_key: row}, **({"secagg_failed": failed} if failed else {}), **(dp or {}),
                          **({} if train_loss is None else {"train_loss": train_loss}))


def secagg_params(cfg) -> SecAggParams:
    """The protocol's parameters from a run config's ``secagg_*`` fields."""
    return SecAggParams(threshold=float(cfg.secagg_threshold), clip=float(cfg.secagg_clip), bits=int(cfg.secagg_bits))


def check_secagg(cfg, entry) -> None:
    """Refuse, in one line, a run config that secure aggregation cannot serve."""
    if not entry.secagg:
        from fedswarm.strategies.secagg_compat import strategy_refusal

        able = ", ".join(e.name for e in registry.entries(registered=True) if e.secagg)
        why = strategy_refusal(entry.name) or ("its server needs each node's own update (robust rules compare "
                                               "updates; top-k, 1-bit and sign codecs send per-node index sets or "
                                               "scales), and secure aggregation reveals only their sum")
        raise ConfigError(f"--secagg: strategy '{cfg.strategy}' cannot run under secure aggregation: {why} "
                          f"(strategies that can: {able})")
    if cfg.byzantine:
        raise ConfigError("--secagg with --byzantine: the attacks rewrite each node's plain reply, which secure "
                          "aggregation never shows the server")
    if cfg.dp:  # distributed DP: the nodes clip and noise (server/secagg_dp.py)
        check_distributed_dp(cfg.dp)
    if cfg.clients < 2:
        raise ConfigError("--secagg needs at least 2 clients: with one, the sum is that node's update")
    if cfg.fleet_options():  # the fleet grid closes and samples rounds under the protocol's own stages
        raise ConfigError(f"--secagg with {', '.join(cfg.fleet_options())}: not supported yet (secure aggregation "
                          f"runs its own four stages per round and recovers dropouts itself; quorum, eligibility "
                          f"and availability are not wired into them)")
