"""A node's half of SecAgg+ as a pure state machine: no I/O, its state a flat dict of bytes,
ints and lists (:meth:`SecAggClient.to_state`), so a Flower ClientApp can keep it in
``context.state`` between the stages' messages.

Stages (each method refuses, with :class:`SecAggRefused`, a message that is not the next
stage of the current round):

0. :meth:`advertise` on a :class:`Setup`: draws two X25519 key pairs and the round's secret (its
   self-mask seed derives from it), returns the public halves and a commitment to the seed
   (:func:`seed_commitment`).
1. :meth:`share_keys`: checks its own keys came back unchanged and enough neighbours
   advertised, derives its self-mask seed ``b``, Shamir-shares ``b`` and its mask private key
   among its neighbourhood (itself included, threshold ``t``) and encrypts each neighbour's
   pair of shares under the key it agrees with that neighbour (AES-GCM, the round, sender and
   receiver bound in).
2. :meth:`masked_input`: decrypts the shares it received (their senders are the neighbours
   that reached stage 1), and masks its encoded input:
   ``y = x + PRG(b) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)`` mod ``2^bits``.
3. :meth:`unmask`: for each neighbour, either its ``b`` share (it sent a masked input) or its
   mask-key share (it dropped after sharing), never both: a request naming one neighbour in
   both lists, a survivor list without the node itself, or fewer than ``t`` survivors is refused.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag

from fedswarm.algorithms.secagg import crypto, masking, shamir
from fedswarm.algorithms.secagg.graph import neighbours
from fedswarm.algorithms.secagg.messages import (ADVERTISE, MASKED_INPUT, SHARE_KEYS, STAGES, UNMASK, Keys,
                                                 MaskedInputRequest, SecAggRefused, Setup, ShareKeysRequest,
                                                 UnmaskReply, UnmaskRequest, check_vector)
from fedswarm.algorithms.secagg.quantize import Quantizer

__all__ = ["SecAggClient", "mask_info", "pair_sign", "seed_commitment", "share_info", "share_plaintext"]

_DONE = UNMASK + 1


def share_info(round_id: bytes) -> bytes:
    return b"fedswarm-secagg/share/" + round_id


def mask_info(round_id: bytes) -> bytes:
    return b"fedswarm-secagg/mask/" + round_id


def _self_mask_seed(round_secret: bytes) -> bytes:
    return crypto.derive(round_secret, b"self-mask seed")


def seed_commitment(round_id: bytes, node: int, seed: bytes) -> bytes:
    """What a node advertises of its self-mask seed: SHA-256 of the seed (32 random bytes), bound
    to the round and the node. The server checks a seed rebuilt from shares against it."""
    return hashlib.sha256(b"fedswarm-secagg/seed-commit/" + round_id + struct.pack(">Q", node) + seed).digest()


def pair_sign(own: int, other: int) -> int:
    """+1 if node ``own`` adds the mask it shares with ``other``, -1 if it subtracts it."""
    return 1 if other > own else -1


def share_associated(round_id: bytes, src: int, dst: int) -> bytes:
    return round_id + struct.pack(">QQ", src, dst)


def share_plaintext(src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    return struct.pack(">QQ", src, dst) + seed_share + key_share


def reduce(acc: np.ndarray, bits: int) -> np.ndarray:
    """Field words summed unreduced, as uint64 elements of Z_{2^bits}."""
    out = acc.astype(np.uint64)
    if bits < 64:
        out &= np.uint64((1 << bits) - 1)
    return out


class SecAggClient:
    """One node's SecAgg+ state across one round's four stages (see the module docstring)."""

    def __init__(self, node_id: int, state: dict[str, Any] | None = None):
        self.node_id = int(node_id)
        self.s: dict[str, Any] = dict(state) if state else {"stage": ADVERTISE, "round_id": b""}

    # -- state -------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The node's state: values are bytes, ints, floats and lists of those."""
        return dict(self.s)

    @property
    def setup(self) -> Setup:
        s = self.s
        return Setup(round_id=s["round_id"], node_ids=tuple(s["node_ids"]), degree=s["degree"],
                     threshold=s["threshold"], graph_seed=s["graph_seed"], dim=s["dim"], clip=s["clip"],
                     bits=s["bits"], weight_max=s["weight_max"], noise_bound=s["noise_bound"])

    def quantizer(self) -> Quantizer:
        """The round's quantizer (all nodes of the round build the same one from the setup)."""
        st = self.setup
        return Quantizer(clip=st.clip, bits=st.bits, n_max=len(st.node_ids), weight_max=st.weight_max,
                         noise_bound=st.noise_bound)

    def expect(self, round_id: bytes, stage: int) -> None:
        """Refuse (SecAggRefused) a ``stage`` message of ``round_id`` that is not the next of this node's round."""
        have, want = self.s["round_id"], self.s["stage"]
        if round_id != have:
            raise SecAggRefused(f"node {self.node_id} refuses a '{STAGES[stage]}' message for another round "
                                f"(it is in round {have.hex() or '-'}, the message is for {round_id.hex()})")
        if stage != want:
            what = "replayed" if stage < want else "out-of-order"
            expected = STAGES[want] if want < _DONE else "none (the round is over)"
            raise SecAggRefused(f"node {self.node_id} refuses a {what} '{STAGES[stage]}' message: "
                                f"the next stage of its round is {expected}")

    def _x(self, node: int) -> int:
        return self.s["node_ids"].index(node) + 1

    # -- stage 0 -----------------------------------------------------------------------------
    def advertise(self, setup: Setup) -> Keys:
        if setup.stage != ADVERTISE:
            raise SecAggRefused(f"node {self.node_id} refuses a setup carrying stage {setup.stage}")
        if setup.round_id == self.s.get("round_id") and self.s.get("stage", ADVERTISE) != ADVERTISE:
            raise SecAggRefused(f"node {self.node_id} refuses a replayed 'advertise' message for round "
                                f"{setup.round_id.hex()}")
        if setup.round_id in self.s.get("past_rounds", []):
            raise SecAggRefused(f"node {self.node_id} refuses a setup reusing a past round id {setup.round_id.hex()}")
        ids = sorted(int(i) for i in setup.node_ids)
        if self.node_id not in ids:
            raise SecAggRefused(f"node {self.node_id} is not among the round's nodes")
        hood = len(neighbours(ids, setup.degree, setup.graph_seed)[self.node_id]) + 1
        if not hood // 2 < setup.threshold <= hood:
            raise SecAggRefused(f"node {self.node_id} refuses threshold {setup.threshold}: with a neighbourhood of "
                                f"{hood} it must be in ({hood // 2}, {hood}] (more than half, so no two disjoint "
                                f"sets of shares can both reach it)")
        past = list(self.s.get("past_rounds", []))
        if self.s.get("round_id"):
            past = (past + [self.s["round_id"]])[-16:]
        c, s = crypto.KeyPair(), crypto.KeyPair()
        # Everything stage 1 draws comes from this secret: a stage run twice (a ClientApp task re-run
        # on a node) shares the same self-mask seed with the same polynomials, so a server holding the
        # shares of one run and a node holding the state of the other still agree.
        round_secret = crypto.new_seed()
        seed = _self_mask_seed(round_secret)
        self.s = {"stage": SHARE_KEYS, "round_id": setup.round_id, "past_rounds": past, "node_ids": ids,
                  "degree": int(setup.degree), "threshold": int(setup.threshold),
                  "graph_seed": int(setup.graph_seed), "dim": int(setup.dim), "clip": float(setup.clip),
                  "bits": int(setup.bits), "weight_max": int(setup.weight_max),
                  "noise_bound": int(setup.noise_bound), "c_sk": c.private_bytes, "s_sk": s.private_bytes,
                  "c_pk": c.public_bytes, "s_pk": s.public_bytes, "round_secret": round_secret}
        self.quantizer()  # a setup whose field cannot hold the round's sum is refused here, not at stage 2
        return Keys(c.public_bytes, s.public_bytes, seed_commitment(setup.round_id, self.node_id, seed))

    # -- stage 1 -----------------------------------------------------------------------------
    def share_keys(self, req: ShareKeysRequest) -> dict[int, bytes]:
        self.expect(req.round_id, req.stage)
        s = self.s
        mine = req.keys.get(self.node_id)
        if mine is None or mine.c_public != s["c_pk"] or mine.s_public != s["s_pk"]:
            raise SecAggRefused(f"node {self.node_id} refuses the key list: its own keys are missing or replaced")
        hood = set(neighbours(s["node_ids"], s["degree"], s["graph_seed"])[self.node_id])
        others = {int(j): k for j, k in req.keys.items() if int(j) != self.node_id}
        if not set(others) <= hood:
            raise SecAggRefused(f"node {self.node_id} refuses keys of non-neighbours {sorted(set(others) - hood)}")
        if len(others) + 1 < s["threshold"]:
            raise SecAggRefused(f"node {self.node_id}: only {len(others) + 1} of its neighbourhood advertised keys, "
                                f"fewer than the threshold {s['threshold']}")
        if len({k.c_public for k in req.keys.values()}) != len(req.keys):
            raise SecAggRefused(f"node {self.node_id} refuses a key list where two nodes share a public key")
        secret = s["round_secret"]
        seed = _self_mask_seed(secret)
        holders = sorted(req.keys)
        xs = [self._x(j) for j in holders]
        seed_shares = shamir.split(seed, xs, s["threshold"], coeff_key=crypto.derive(secret, b"seed polynomial"))
        key_shares = shamir.split(s["s_sk"], xs, s["threshold"], coeff_key=crypto.derive(secret, b"key polynomial"))
        own_c = crypto.KeyPair(s["c_sk"])
        out: dict[int, bytes] = {}
        for j, bs, ks in zip(holders, seed_shares, key_shares, strict=True):
            if j == self.node_id:
                s["own_seed_share"], s["own_key_share"] = bs, ks
                continue
            key = crypto.agree(own_c, others[j].c_public, share_info(s["round_id"]))
            out[j] = crypto.encrypt(key, share_plaintext(self.node_id, j, bs, ks),
                                    share_associated(s["round_id"], self.node_id, j))
        s["seed"] = seed
        s["peer_ids"] = sorted(others)
        s["peer_c"] = [others[j].c_public for j in s["peer_ids"]]
        s["peer_s"] = [others[j].s_public for j in s["peer_ids"]]
        s["stage"] = MASKED_INPUT
        return out

    # -- stage 2 -----------------------------------------------------------------------------
    def masked_input(self, req: MaskedInputRequest, encoded: np.ndarray) -> np.ndarray:
        """``encoded`` (from :meth:`quantizer`'s ``encode``, ``dim + 1`` field elements) masked,
        in the field's word (``crypto.field_dtype``: uint32 up to 32 bits)."""
        self.expect(req.round_id, req.stage)
        s = self.s
        vec = check_vector(encoded, s["dim"] + 1, s["bits"])
        peers = dict(zip(s["peer_ids"], zip(s["peer_c"], s["peer_s"], strict=True), strict=True))
        if not set(req.ciphertexts) <= set(peers):
            raise SecAggRefused(f"node {self.node_id} refuses shares from nodes it holds no keys of: "
                                f"{sorted(set(req.ciphertexts) - set(peers))}")
        if len(req.ciphertexts) + 1 < s["threshold"]:
            raise SecAggRefused(f"node {self.node_id}: only {len(req.ciphertexts) + 1} of its neighbourhood shared "
                                f"keys, fewer than the threshold {s['threshold']}")
        own_c, own_s = crypto.KeyPair(s["c_sk"]), crypto.KeyPair(s["s_sk"])
        senders = sorted(int(j) for j in req.ciphertexts)
        seed_sh, key_sh = [], []
        n = shamir.SHARE_BYTES
        for j in senders:
            key = crypto.agree(own_c, peers[j][0], share_info(s["round_id"]))
            try:
                plain = crypto.decrypt(key, req.ciphertexts[j], share_associated(s["round_id"], j, self.node_id))
            except InvalidTag:
                raise SecAggRefused(f"node {self.node_id}: the share from node {j} does not authenticate") from None
            if len(plain) != 16 + 2 * n or struct.unpack(">QQ", plain[:16]) != (j, self.node_id):
                raise SecAggRefused(f"node {self.node_id}: the share from node {j} is malformed")
            seed_sh.append(plain[16:16 + n])
            key_sh.append(plain[16 + n:])
        masks = [(s["seed"], 1)] + [(crypto.agree(own_s, peers[j][1], mask_info(s["round_id"])),
                                     pair_sign(self.node_id, j)) for j in senders]
        out = masking.reduce_words(masking.apply_masks(masking.field_words(vec, s["bits"]), masks), s["bits"])
        s["senders"], s["seed_shares"], s["key_shares"] = senders, seed_sh, key_sh
        s["stage"] = UNMASK
        return out

    # -- stage 3 -----------------------------------------------------------------------------
    def unmask(self, req: UnmaskRequest) -> UnmaskReply:
        self.expect(req.round_id, req.stage)
        s = self.s
        alive, gone = {int(j) for j in req.survivors}, {int(j) for j in req.dropped}
        both = alive & gone
        if both:
            raise SecAggRefused(f"node {self.node_id} refuses to reveal both the self-mask share and the mask-key "
                                f"share of node(s) {sorted(both)}: that would unmask their input")
        if self.node_id not in alive:
            raise SecAggRefused(f"node {self.node_id} refuses an unmask request that lists it as dropped")
        known = set(s["senders"]) | {self.node_id}
        if not (alive | gone) <= known:
            raise SecAggRefused(f"node {self.node_id} holds no shares of node(s) {sorted((alive | gone) - known)}")
        if len(alive) < s["threshold"]:
            raise SecAggRefused(f"node {self.node_id}: only {len(alive)} survivors in its neighbourhood, fewer than "
                                f"the threshold {s['threshold']}")
        idx = {j: i for i, j in enumerate(s["senders"])}
        out = UnmaskReply()
        for j in sorted(alive):
            out.seed_shares[j] = s["own_seed_share"] if j == self.node_id else s["seed_shares"][idx[j]]
        for j in sorted(gone):
            out.key_shares[j] = s["key_shares"][idx[j]]
        # The round is over for this node: its secrets go, so nothing later can ask for them.
        self.s = {"stage": _DONE, "round_id": s["round_id"], "past_rounds": s.get("past_rounds", [])}
        return out
