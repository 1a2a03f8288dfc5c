"""Byzantine clients in any engine: a Grid wrapper that rewrites K chosen nodes' replies.

:class:`ByzantineGrid` sits between the ServerApp's metered grid and the engine's grid
(in-process, Flower's Simulation Engine, or a deployment's SuperLink), so every engine
gets the same attacks and the bytes counted are those the attackers really send. The
strategy is never told: it sees only replies.

- Which nodes: ``k`` of the grid's node ids, sorted and drawn with the run's seed, once.
- ``update`` attacks (:mod:`fedswarm.algorithms.robust.attacks`): after a round's replies
  arrive, each reply is read as an update vector (a model reply ``arrays`` minus the model
  that node was sent; a codec payload, decoded; any other payload, its float arrays as
  they are), the attack computes the Byzantine vectors from their own and the honest
  ones, and the replies are written back in the same format (a codec payload re-encoded
  with the same codec and seed).
- ``data`` attacks (label flipping): the Byzantine nodes' train messages carry a
  ``byzantine`` ConfigRecord the client's local training obeys (the attacker is the
  client; the aggregator never reads it).
- ``bytes`` attacks: every array of the reply is replaced by random bytes of its size.

After each exchange ``on_attack(nodes, attack_spec)`` is called with the node ids that
attacked, so the recorder puts them in the round's row.

The attack reads the replies in the order their messages were sent (the strategy's sampled
order; a node's latest message counts), whatever order the grid hands them back in: an attack
that draws noise (``gaussian``, ``random``) gives each attacker its draw by that order, so the
same seed gives the same attack on every engine, with or without the fleet options, whether the
grid answers in the order asked (in-process) or as replies arrive (Ray, a deployment).
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable, Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedswarm.algorithms.compression.codecs import CODECS, make_codec
from fedswarm.algorithms.robust.attacks import Attack
from fedswarm.params import ParamLayout
from fedswarm.payload import Payload, PayloadError
from fedswarm.server.metered_grid import WrappingGrid
from fedswarm.wire import PAYLOAD_ARRAYS, PAYLOAD_META, arrayrecord_to_vector, payload_from_records, payload_to_records

__all__ = ["ByzantineGrid", "BYZANTINE_RECORD"]

#: The ConfigRecord a data-poisoning attack adds to a Byzantine node's train message.
BYZANTINE_RECORD = "byzantine"


class _View:
    """One reply read as a float vector, and how to write a new vector back."""

    def __init__(self, vector: torch.Tensor, write: Callable[[torch.Tensor], None], kind: str):
        self.vector, self.write, self.kind = vector, write, kind


class ByzantineGrid(WrappingGrid):
    """Delegates to ``inner``; ``k`` nodes attack with ``attack`` (see the module doc)."""

    def __init__(self, inner: Grid, attack: Attack, k: int, *, seed: int, layout: ParamLayout,
                 on_attack: Callable[[list[int], str], None] | None = None):
        if k < 0:
            raise ValueError(f"the number of Byzantine clients must be >= 0, got {k}")
        super().__init__(inner)
        self.attack, self.k, self.seed, self.layout = attack, int(k), int(seed), layout
        self.on_attack = on_attack
        self._byzantine: list[int] | None = None
        self._sent: dict[int, ArrayRecord] = {}  # node -> the model arrays it was last sent
        self._sent_at: dict[int, int] = {}  # node -> when its latest message was sent (a count): the attack's order
        self._sends = itertools.count()
        self._generator = torch.Generator().manual_seed(seed + 7919)
        self._rng = np.random.default_rng(seed + 104729)

    @property
    def byzantine(self) -> list[int]:
        """The attacking node ids (chosen on first use)."""
        if self._byzantine is None:
            nodes = sorted(int(n) for n in self.inner.get_node_ids())
            if self.k > len(nodes):
                raise ValueError(f"{self.k} Byzantine clients asked for, the federation has {len(nodes)} nodes")
            self._byzantine = sorted(random.Random(self.seed).sample(nodes, self.k))
        return self._byzantine

    # -- checkpoint (fedswarm.server.checkpoint): a resumed run attacks as the first did -----
    def state_dict(self) -> dict:
        return {"byzantine": self._byzantine, "sent": {n: copy.deepcopy(a) for n, a in self._sent.items()},
                "generator": self._generator.get_state(), "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._byzantine = state["byzantine"]
        self._sent = dict(state["sent"])
        self._generator.set_state(state["generator"])
        self._rng.bit_generator.state = state["rng"]

    # -- Grid: messages (the rest is WrappingGrid's) -------------------------------------
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(self._outgoing(list(messages)))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._incoming(list(self.inner.pull_messages(message_ids)))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._incoming(list(self.inner.send_and_receive(self._outgoing(list(messages)), timeout=timeout)))

    # -- the attack ----------------------------------------------------------------------
    def _outgoing(self, messages: list[Message]) -> list[Message]:
        bad = set(self.byzantine)
        for msg in messages:
            nid = msg.metadata.dst_node_id
            self._sent_at[nid] = next(self._sends)
            if nid not in bad or not msg.has_content():
                continue
            arrays = msg.content.array_records.get("arrays")
            if arrays is not None:
                self._sent[nid] = arrays
            if self.attack.kind == "data":
                content = RecordDict(dict(msg.content.items()))  # do not touch a record shared with others
                content[BYZANTINE_RECORD] = ConfigRecord({"attack": self.attack.name})
                msg.content = content
        return messages

    def _incoming(self, replies: list[Message]) -> list[Message]:
        bad = set(self.byzantine)
        # read in the order sent (see the module's doc); the replies go on in the order they came
        sent_at = self._sent_at  # (a reply to a message this grid did not send: after the others, by node id)
        ordered = sorted(replies, key=lambda m: (m.metadata.src_node_id not in sent_at,
                                                 sent_at.get(m.metadata.src_node_id, 0), m.metadata.src_node_id))
        attacked = [m for m in ordered if m.metadata.src_node_id in bad and not m.has_error() and m.has_content()]
        if attacked:
            if self.attack.kind == "update":
                self._rewrite(ordered, attacked)
            elif self.attack.kind == "bytes":
                for m in attacked:
                    self._scramble(m)
            if self.on_attack is not None:
                self.on_attack(sorted(m.metadata.src_node_id for m in attacked), self.attack.spec)
        return replies

    def _rewrite(self, replies: list[Message], attacked: list[Message]) -> None:
        views = {id(m): self._view(m) for m in replies if not m.has_error() and m.has_content()}
        bad_views = [views[id(m)] for m in attacked if views.get(id(m)) is not None]
        if not bad_views:
            return
        kind, size = bad_views[0].kind, bad_views[0].vector.numel()
        bad_ids = {id(m) for m in attacked}
        honest = [v.vector for m in replies if (v := views.get(id(m))) is not None and id(m) not in bad_ids
                  and v.kind == kind and v.vector.numel() == size]
        bad_views = [v for v in bad_views if v.kind == kind and v.vector.numel() == size]
        own = torch.stack([v.vector for v in bad_views])
        hon = torch.stack(honest) if honest else own.new_zeros((0, size))
        out = self.attack.apply(own, hon, len(replies), self._generator)
        for v, row in zip(bad_views, out):
            v.write(row)

    def _view(self, msg: Message) -> _View | None:
        content = msg.content
        nid = msg.metadata.src_node_id
        if PAYLOAD_ARRAYS in content.array_records and PAYLOAD_META in content.config_records:
            try:
                payload = payload_from_records(content)
            except PayloadError:
                return None
            name = payload.meta.get("codec")
            if name in CODECS:
                try:
                    vec = CODECS[name]().decode(payload, self.layout)
                except PayloadError:
                    return None
                if vec.shape[0] != 1:
                    return None

                def write_codec(x: torch.Tensor, meta=dict(payload.meta), name=name) -> None:  # noqa: B006 (bound now)
                    params = {h.name: meta[h.name] for h in CODECS[name].hyperparams}
                    new = make_codec(name, **params).encode(x[None].float(), self.layout, seed=int(meta["seed"]))
                    payload_to_records(new, content)

                return _View(vec[0].float(), write_codec, f"codec:{name}")
            floats = {k: np.asarray(a) for k, a in payload.arrays.items() if np.asarray(a).dtype.kind == "f"}
            if not floats:
                return None
            flat = torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.float32) for a in floats.values()]))

            def write_raw(x: torch.Tensor, payload=payload, floats=floats) -> None:
                arrays, off = dict(payload.arrays), 0
                for key, a in floats.items():
                    arrays[key] = x[off:off + a.size].numpy().astype(a.dtype).reshape(a.shape)
                    off += a.size
                payload_to_records(Payload(arrays, dict(payload.meta)), content)

            return _View(flat, write_raw, "raw:" + ",".join(floats))
        rec = content.array_records.get("arrays")
        if rec is not None:
            try:
                model = arrayrecord_to_vector(rec)
            except PayloadError:
                return None
            sent = self._sent.get(nid)
            ref = arrayrecord_to_vector(sent) if sent is not None else None
            if ref is None or ref.numel() != model.numel():
                ref = torch.zeros_like(model)
            keys = [(k, tuple(rec[k].shape)) for k in rec.keys()]

            def write_model(x: torch.Tensor, ref=ref, keys=keys) -> None:
                new, full, off = ArrayRecord(), (ref + x).numpy(), 0
                for key, shape in keys:
                    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
                    new[key] = Array(np.ascontiguousarray(full[off:off + n].reshape(shape).astype(np.float32)))
                    off += n
                content["arrays"] = new

            return _View(model - ref, write_model, "model")
        return None

    def _scramble(self, msg: Message) -> None:
        content = msg.content
        for name in list(content.array_records.keys()):
            rec, new = content.array_records[name], ArrayRecord()
            for key in rec.keys():
                arr = rec[key].numpy()
                raw = self._rng.integers(0, 256, size=arr.nbytes, dtype=np.uint8)
                new[key] = Array(np.ascontiguousarray(raw.view(arr.dtype).reshape(arr.shape)))
            content[name] = new
