"""The server's half of SecAgg+ as a pure state machine: it routes keys and encrypted shares
between nodes, sums the masked inputs and removes the masks with the shares the survivors
return. It never holds a node's plain input; what it ends with is the sum.

A node that does not answer a stage (absent from that stage's replies) has dropped:

- before stage 1's shares went out: it is left out, nobody masks against it;
- after sharing but before its masked input: it *dropped after sharing*; its neighbours'
  masks with it are recovered from its mask key, rebuilt from ``t`` of its neighbours' shares;
- after its masked input: its self-mask seed is rebuilt from ``t`` shares as any survivor's.

Before masks are committed (stage 2's requests) the server also leaves out any node whose
neighbourhood among those still active is below the threshold ``t``; past stage 2, a secret
with fewer than ``t`` returned shares fails the round (:class:`SecAggFailed`, naming it).

A rebuilt secret is checked against what its owner advertised at stage 0: a mask key against
its public key, a self-mask seed against its commitment (:func:`~.client.seed_commitment`). A
subset of shares that rebuilds something else holds a corrupt share: the server tries other
``t``-subsets (when more than ``t`` came back), names the shares off the right polynomial
(``RoundReport.bad_shares``), and fails the round when no subset rebuilds the advertised secret.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedswarm.algorithms.secagg import crypto, shamir
from fedswarm.algorithms.secagg.client import mask_info, pair_sign, reduce, seed_commitment
from fedswarm.algorithms.secagg.masking import apply_masks
from fedswarm.algorithms.secagg.graph import default_degree, neighbours
from fedswarm.algorithms.secagg.messages import (Keys, MaskedInputRequest, SecAggFailed, Setup, ShareKeysRequest,
                                                 UnmaskReply, UnmaskRequest, check_vector)
from fedswarm.algorithms.secagg.quantize import Quantizer

__all__ = ["RoundReport", "SecAggParams", "SecAggServer", "threshold_for"]


def threshold_for(hood: int, threshold: float) -> int:
    """The share threshold ``t`` for a neighbourhood of ``hood`` nodes (itself included):
    ``threshold`` is a fraction of it in (0.5, 1] (rounded up), or a count >= 2; ``t`` must
    be more than half the neighbourhood."""
    t = int(np.ceil(threshold * hood - 1e-9)) if threshold <= 1 else int(threshold)
    t = max(t, hood // 2 + 1)
    return min(t, hood)


@dataclass(frozen=True)
class SecAggParams:
    """One round's knobs: ``threshold`` (fraction of a neighbourhood, or a count), ``clip``
    and ``bits`` (the quantizer), ``weight_max`` (a node's largest weight), ``degree`` (``None``:
    :func:`default_degree`) and ``noise_bound`` (what a DP hook may add per coordinate)."""

    threshold: float = 0.6
    clip: float = 1.0
    bits: int = 32
    weight_max: int = 1 << 16
    degree: int | None = None
    noise_bound: int = 0


@dataclass
class RoundReport:
    """What the server learnt about the round's membership (it goes to the round's metrics)."""

    participants: int = 0
    advertised: int = 0
    shared: int = 0
    masked: int = 0
    dropped_after_sharing: int = 0
    recovered: int = 0
    threshold: int = 0
    degree: int = 0
    field_bits: int = 0
    #: corrupt shares caught at unmasking: "holder>owner:seed" / "holder>owner:key"
    bad_shares: list[str] = field(default_factory=list)


class SecAggServer:
    """The server's side of one SecAgg+ round over ``node_ids`` for updates of ``dim`` floats."""

    def __init__(self, node_ids: Sequence[int], dim: int, params: SecAggParams, *,
                 round_id: bytes | None = None, graph_seed: int | None = None):
        ids = sorted(int(i) for i in node_ids)
        if len(ids) < 2:
            raise SecAggFailed(f"secure aggregation needs at least 2 nodes, the round has {len(ids)}", "advertise")
        self.ids, self.dim, self.params = ids, int(dim), params
        self.degree = min(len(ids) - 1, params.degree if params.degree is not None else default_degree(len(ids)))
        self.graph_seed = secrets.randbits(63) if graph_seed is None else int(graph_seed)
        self.graph = neighbours(ids, self.degree, self.graph_seed)
        hood = min(len(v) for v in self.graph.values()) + 1
        self.threshold = threshold_for(hood, params.threshold)
        self.quantizer = Quantizer(clip=params.clip, bits=params.bits, n_max=len(ids),
                                   weight_max=params.weight_max, noise_bound=params.noise_bound)
        self.round_id = round_id if round_id is not None else secrets.token_bytes(16)
        self.report = RoundReport(participants=len(ids), threshold=self.threshold, degree=self.degree,
                                  field_bits=params.bits)
        self._keys: dict[int, Keys] = {}
        self._shared: set[int] = set()
        self._masked: dict[int, np.ndarray] = {}
        self._hood_cache: dict[int, set[int]] = {}

    def _fail(self, reason: str, stage: str):
        raise SecAggFailed(reason, stage)

    def _prune(self, active: set[int]) -> set[int]:
        """``active`` less every node whose active neighbourhood (itself included) is below t."""
        while True:
            thin = {i for i in active if len(set(self.graph[i]) & active) + 1 < self.threshold}
            if not thin:
                return active
            active = active - thin

    # -- stage 0 -----------------------------------------------------------------------------
    def setup(self) -> dict[int, Setup]:
        p = self.params
        msg = Setup(round_id=self.round_id, node_ids=tuple(self.ids), degree=self.degree, threshold=self.threshold,
                    graph_seed=self.graph_seed, dim=self.dim, clip=float(p.clip), bits=int(p.bits),
                    weight_max=int(p.weight_max), noise_bound=int(p.noise_bound))
        return dict.fromkeys(self.ids, msg)

    # -- stage 1 -----------------------------------------------------------------------------
    def collect_keys(self, replies: Mapping[int, Keys]) -> dict[int, ShareKeysRequest]:
        # an advertisement without a seed commitment cannot have its seed checked at unmasking: left out
        self._keys = {int(i): k for i, k in replies.items() if int(i) in self.graph and len(k.seed_commit) == 32}
        self.report.advertised = len(self._keys)
        active = self._prune(set(self._keys))
        if len(active) < self.threshold:
            self._fail(f"{len(active)} nodes advertised keys with enough neighbours, fewer than the threshold "
                       f"{self.threshold}", "advertise")
        return {i: ShareKeysRequest(self.round_id, {j: self._keys[j] for j in [i, *self.graph[i]] if j in active})
                for i in sorted(active)}

    # -- stage 2 -----------------------------------------------------------------------------
    def collect_shares(self, replies: Mapping[int, Mapping[int, bytes]]) -> dict[int, MaskedInputRequest]:
        sent = {int(i): dict(v) for i, v in replies.items() if int(i) in self._keys}
        active = self._prune(set(sent))
        self._shared = active
        self.report.shared = len(active)
        if len(active) < self.threshold:
            self._fail(f"{len(active)} nodes shared their keys with enough neighbours, fewer than the threshold "
                       f"{self.threshold}", "share_keys")
        out: dict[int, MaskedInputRequest] = {}
        for i in sorted(active):
            cts = {j: sent[j][i] for j in self.graph[i] if j in active and i in sent[j]}
            out[i] = MaskedInputRequest(self.round_id, cts)
        return out

    # -- stage 3 -----------------------------------------------------------------------------
    def collect_masked(self, replies: Mapping[int, np.ndarray]) -> dict[int, UnmaskRequest]:
        size = self.dim + 1
        self._masked = {int(i): check_vector(v, size, self.params.bits)
                        for i, v in replies.items() if int(i) in self._shared}
        alive = set(self._masked)
        self.report.masked = len(alive)
        self.report.dropped_after_sharing = len(self._shared - alive)
        if len(alive) < self.threshold:
            self._fail(f"{len(alive)} nodes sent a masked input, fewer than the threshold {self.threshold}",
                       "masked_input")
        gone = self._shared - alive
        out = {}
        for i in sorted(alive):
            hood = set(self.graph[i]) | {i}
            out[i] = UnmaskRequest(self.round_id, tuple(sorted(hood & alive)), tuple(sorted(hood & gone)))
        return out

    # -- the end -----------------------------------------------------------------------------
    def collect_unmask(self, replies: Mapping[int, UnmaskReply]) -> np.ndarray:
        """The unmasked sum (``[dim + 1]`` in the field's word, in Z_{2^bits}) of the survivors' encoded inputs."""
        bits = self.params.bits
        answered = {int(i): r for i, r in replies.items() if int(i) in self._masked}
        alive = set(self._masked)
        gone = self._shared - alive
        x = {j: self.ids.index(j) + 1 for j in self.ids}

        def rebuild(owner: int, kind: str) -> bytes:
            what = "self-mask seed" if kind == "seed_shares" else "mask key"
            holders = [h for h, r in answered.items()
                       if owner in getattr(r, kind) and (h == owner or h in self.graph[owner])]
            if len(holders) < self.threshold:
                self._fail(f"node {owner}'s {what} has {len(holders)} shares back, fewer than the threshold "
                           f"{self.threshold} ({len(answered)} of {len(alive)} survivors answered the unmask stage)",
                           "unmask")
            advertised = self._keys[owner]
            if kind == "seed_shares":
                def verify(secret: bytes) -> bool:
                    return seed_commitment(self.round_id, owner, secret) == advertised.seed_commit
            else:
                def verify(secret: bytes) -> bool:
                    return len(secret) == 32 and crypto.KeyPair(secret).public_bytes == advertised.s_public
            holder_at = {x[h]: h for h in holders}
            try:
                secret, bad = shamir.recover([(x[h], getattr(answered[h], kind)[owner]) for h in holders],
                                             self.threshold, verify)
            except ValueError as err:
                self._fail(f"node {owner}'s {what} does not reconstruct to what it advertised from the {len(holders)} "
                           f"shares of nodes {sorted(holders)}: {err}", "unmask")
                raise
            self.report.bad_shares += [f"{holder_at[b]}>{owner}:{kind.split('_')[0]}" for b in bad]
            return secret

        total = np.zeros(self.dim + 1, dtype=crypto.field_dtype(bits))
        for v in self._masked.values():
            total += v.astype(total.dtype, copy=False)
        masks = [(rebuild(i, "seed_shares"), -1) for i in sorted(alive)]
        for j in sorted(gone):
            sk = crypto.KeyPair(rebuild(j, "key_shares"))
            # Node i added sign(i, j) * mask; take it back out.
            masks += [(crypto.agree(sk, self._keys[i].s_public, mask_info(self.round_id)), -pair_sign(i, j))
                      for i in sorted(alive & set(self.graph[j]))]
        apply_masks(total, masks)
        self.report.recovered = len(gone)
        return reduce(total, bits)
