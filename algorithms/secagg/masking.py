"""The mask arithmetic of SecAgg+, in place: a vector of field words plus or minus the AES-CTR
keystreams of many seeds, without a d-long temporary per seed.

A node at degree ``k`` adds ``k + 1`` masks of ``d`` words to its encoded input (its self mask
and one per neighbour that shared keys); the server takes back one self mask per survivor and,
per node that dropped after sharing, the pairwise mask of each of its surviving neighbours.
:func:`apply_masks` does either in one pass over the vector: for each chunk of
``CHUNK_WORDS`` words, every seed's cipher writes its next chunk of keystream into one small
scratch buffer (``update_into``: no allocation, no copy) and numpy adds or subtracts it from the
vector's chunk in place, wrapping in the word (uint32 up to 32 field bits, else uint64). Vector
chunk, scratch and zero input stay in cache across all seeds; the vector crosses memory once.

The keystream of a seed does not depend on how it is cut into chunks, so the result is the
same, bit for bit, as expanding each mask whole (:func:`crypto.prg_words`) and summing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from fedswarm.algorithms.secagg import crypto

__all__ = ["CHUNK_WORDS", "apply_masks", "field_words", "reduce_words"]

#: Words per chunk: 64 KiB of uint32 keystream, well inside a core's L2 with the vector's chunk.
CHUNK_WORDS = 1 << 14
#: The keystream is read as little-endian words (as :func:`crypto.prg_words` reads it) on any host.
_SWAP = sys.byteorder != "little"


def field_words(v: np.ndarray, bits: int) -> np.ndarray:
    """A fresh contiguous copy of the field elements ``v`` in the field's word
    (:func:`crypto.field_dtype`): the array :func:`apply_masks` works on."""
    return np.array(v, dtype=crypto.field_dtype(bits), order="C", copy=True)


def reduce_words(acc: np.ndarray, bits: int) -> np.ndarray:
    """``acc`` reduced mod ``2^bits`` in place (a no-op when ``bits`` is the word's width); returns it."""
    if bits < acc.dtype.itemsize * 8:
        acc &= acc.dtype.type((1 << bits) - 1)
    return acc


def apply_masks(acc: np.ndarray, masks: Sequence[tuple[bytes, int]], chunk: int = CHUNK_WORDS) -> np.ndarray:
    """``acc += sum(sign * PRG(seed))`` over ``masks`` (pairs of a 32-byte seed and a sign, +1 or
    -1), in place in ``acc``'s word (uint32 or uint64, C-contiguous, writable), wrapping mod
    the word's range; returns ``acc``. Reduce mod ``2^bits`` with :func:`reduce_words`."""
    if acc.dtype not in (np.dtype(np.uint32), np.dtype(np.uint64)) or acc.ndim != 1:
        raise ValueError(f"secagg masks apply to a flat uint32 or uint64 vector, got {acc.dtype} {acc.shape}")
    if not (acc.flags.c_contiguous and acc.flags.writeable):
        raise ValueError("secagg masks apply in place: the vector must be C-contiguous and writable")
    if int(chunk) < 1:
        raise ValueError(f"secagg mask chunk must be >= 1 word, got {chunk}")
    streams = []
    for seed, sign in masks:
        if sign not in (1, -1):
            raise ValueError(f"secagg mask sign must be +1 or -1, got {sign}")
        streams.append((crypto.keystream(seed), np.add if sign > 0 else np.subtract))
    if not streams or acc.size == 0:
        return acc
    step = min(int(chunk), acc.size)
    raw = bytearray(step * acc.itemsize)  # the keystream lands here; ``words`` reads it in place
    zeros = memoryview(bytes(len(raw)))
    for lo in range(0, acc.size, step):
        part = acc[lo:lo + step]
        k = part.size
        if lo == 0 or k < step:
            out, zs = memoryview(raw)[:k * acc.itemsize], zeros[:k * acc.itemsize]
            ks = np.frombuffer(out, dtype=acc.dtype)
        for cipher, op in streams:
            cipher.update_into(zs, out)
            if _SWAP:
                ks.byteswap(inplace=True)
            op(part, ks, out=part)
    return acc
