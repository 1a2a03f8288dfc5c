"""The SecAgg+ stages' messages, as plain data (bytes, ints, numpy arrays), and the protocol's
errors. The Flower halves (``fedswarm.client.secagg_mod``, ``fedswarm.server.secagg``) turn
them into records; the state machines (``client.py``, ``server.py``) only see these.

A round has four stages, numbered in the order a node must see them; every server message
carries the round's id and its stage, and a node refuses one that is not the next stage of
its current round (:class:`SecAggRefused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ADVERTISE", "MASKED_INPUT", "SHARE_KEYS", "STAGES", "UNMASK", "Keys", "MaskedInputRequest",
           "SecAggError", "SecAggFailed", "SecAggRefused", "Setup", "ShareKeysRequest", "UnmaskReply",
           "UnmaskRequest"]

ADVERTISE, SHARE_KEYS, MASKED_INPUT, UNMASK = 0, 1, 2, 3
#: Stage names, by number (metrics and message types use them).
STAGES = ("advertise", "share_keys", "masked_input", "unmask")


class SecAggError(Exception):
    """Base of the protocol's errors."""


class SecAggRefused(SecAggError):
    """A node refuses a server message that breaks the protocol (a replayed, re-ordered or
    foreign-round stage, a request for both shares of one neighbour, a substituted key)."""


class SecAggFailed(SecAggError):
    """The server cannot finish the round (too few nodes or shares left); ``reason`` says why."""

    def __init__(self, reason: str, stage: str):
        super().__init__(f"secure aggregation failed at stage '{stage}': {reason}")
        self.reason = reason
        self.stage = stage


@dataclass(frozen=True)
class Setup:
    """Stage 0, server to node: the round's parameters. ``node_ids`` are all the round's nodes
    (sorted); a node derives its neighbours from them, ``degree`` and ``graph_seed``."""

    round_id: bytes
    node_ids: tuple[int, ...]
    degree: int
    threshold: int
    graph_seed: int
    dim: int
    clip: float
    bits: int
    weight_max: int
    noise_bound: int = 0
    stage: int = ADVERTISE


@dataclass(frozen=True)
class Keys:
    """Stage 0 reply: a node's two X25519 public keys (``c`` encrypts shares, ``s`` agrees masks)
    and ``seed_commit``, a hash of its self-mask seed (the server checks a seed rebuilt from
    shares against it; neighbours are sent the keys only)."""

    c_public: bytes
    s_public: bytes
    seed_commit: bytes = b""


@dataclass(frozen=True)
class ShareKeysRequest:
    """Stage 1, server to node: the public keys of its neighbours that advertised (and its own)."""

    round_id: bytes
    keys: dict[int, Keys]
    stage: int = SHARE_KEYS


@dataclass(frozen=True)
class MaskedInputRequest:
    """Stage 2, server to node: the encrypted shares its neighbours sent it (by sender)."""

    round_id: bytes
    ciphertexts: dict[int, bytes]
    stage: int = MASKED_INPUT


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 3, server to node: which of its neighbours sent a masked input (``survivors``: the
    server wants their self-mask shares) and which shared keys but then dropped (``dropped``:
    their mask-key shares)."""

    round_id: bytes
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    stage: int = UNMASK


@dataclass(frozen=True)
class UnmaskReply:
    """Stage 3 reply: self-mask-seed shares of survivors and mask-key shares of dropped nodes."""

    seed_shares: dict[int, bytes] = field(default_factory=dict)
    key_shares: dict[int, bytes] = field(default_factory=dict)


def check_vector(v: np.ndarray, dim: int, bits: int) -> np.ndarray:
    """``v`` as uint32 or uint64 ``[dim]`` in Z_{2^bits}, or a ValueError naming what is wrong."""
    v = np.asarray(v)
    if v.dtype not in (np.uint32, np.uint64) or v.shape != (dim,):
        raise ValueError(f"secagg: a masked input must be uint32 or uint64 of shape ({dim},), got {v.dtype} {v.shape}")
    if bits < v.itemsize * 8 and int(v.max(initial=0)) >> bits:
        raise ValueError(f"secagg: a masked input has values outside Z_2^{bits}")
    return v
