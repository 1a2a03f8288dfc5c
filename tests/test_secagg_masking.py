"""SecAgg+'s fast masking path (algorithms/secagg/masking.py and the chunked ``Quantizer.encode``)
against slow references written here: masks expanded whole from AES-256-CTR and summed as Python
integers mod 2^b, and the quantizer's definition done on whole float64 vectors. Bit for bit, for
fields narrower than, equal to and wider than the 32-bit word."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedswarm.algorithms.secagg import Quantizer, SecAggClient, SecAggParams, SecAggServer, crypto, masking
from fedswarm.algorithms.secagg.client import mask_info, pair_sign
from fedswarm.algorithms.secagg.quantize import CHUNK

BITS = [20, 32, 40, 64]


def _ref_mask(seed: bytes, d: int, bits: int) -> list[int]:
    """The PRG's definition: AES-256-CTR keystream (zero counter) read as little-endian words of 4
    bytes (b <= 32) or 8 bytes, reduced mod 2^b."""
    width = 4 if bits <= 32 else 8
    raw = Cipher(algorithms.AES(seed), modes.CTR(b"\0" * 16)).encryptor().update(bytes(width * d))
    return [int.from_bytes(raw[i * width:(i + 1) * width], "little") % (1 << bits) for i in range(d)]


def _ref_masked(x, masks, bits):
    acc = [int(v) for v in x]
    for seed, sign in masks:
        acc = [a + sign * m for a, m in zip(acc, _ref_mask(seed, len(acc), bits), strict=True)]
    return np.array([a % (1 << bits) for a in acc], dtype=np.uint64)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("chunk", [7, 64, masking.CHUNK_WORDS])
def test_apply_masks_equals_whole_masks_summed_as_integers(bits, chunk):
    d = 1001  # not a multiple of any chunk: a ragged last chunk
    rng = np.random.default_rng(bits)
    x = rng.integers(0, 1 << bits, d, dtype=np.uint64, endpoint=False) if bits < 64 else \
        rng.integers(0, 1 << 63, d, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    masks = [(bytes([i]) * 32, (-1) ** i) for i in range(5)]
    acc = masking.field_words(x, bits)
    assert acc.dtype == (np.uint32 if bits <= 32 else np.uint64)
    got = masking.reduce_words(masking.apply_masks(acc, masks, chunk=chunk), bits)
    np.testing.assert_array_equal(got.astype(np.uint64), _ref_masked(x, masks, bits))
    # the whole-vector PRG reads the same stream
    np.testing.assert_array_equal(crypto.prg_mask(masks[0][0], d, bits), np.array(_ref_mask(masks[0][0], d, bits),
                                                                                     dtype=np.uint64))


def test_apply_masks_refuses_what_it_cannot_do_in_place():
    with pytest.raises(ValueError, match="flat uint32 or uint64"):
        masking.apply_masks(np.zeros(4, np.int64), [(b"k" * 32, 1)])
    with pytest.raises(ValueError, match="C-contiguous and writable"):
        masking.apply_masks(np.zeros(8, np.uint32)[::2], [(b"k" * 32, 1)])
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        masking.apply_masks(np.zeros(4, np.uint32), [(b"k" * 32, 2)])
    with pytest.raises(ValueError, match="32 bytes"):
        masking.apply_masks(np.zeros(4, np.uint32), [(b"k" * 16, 1)])


def _ref_encode(q: Quantizer, x, rng, weight, noise=None):
    """The quantizer's definition on whole vectors: clip in float64, times scale * weight, plus
    rng.random(d), floor, plus the noise, the weight appended, mod 2^b (as Python ints)."""
    v = np.clip(np.asarray(x, dtype=np.float64), -q.clip, q.clip) * (q.scale * weight)
    ints = np.floor(v + rng.random(v.size)).astype(np.int64)
    if noise is not None:
        ints = ints + noise
    return np.array([int(a) % (1 << q.bits) for a in [*ints, weight]], dtype=np.uint64)


@pytest.mark.parametrize("bits", BITS)
def test_encode_equals_the_whole_vector_definition(bits):
    d = 2 * CHUNK + 5  # three chunks, the last ragged
    q = Quantizer(clip=0.3, bits=bits, n_max=7, weight_max=9, noise_bound=50)
    x = np.random.default_rng(1).normal(0.0, 0.4, d).astype(np.float32)  # some past the clip
    noise = np.random.default_rng(2).integers(-50, 51, d)
    got = q.encode(x, np.random.default_rng(3), weight=9, noise=lambda n, r: noise)
    assert got.dtype == (np.uint32 if bits <= 32 else np.uint64) and got.shape == (d + 1,)
    np.testing.assert_array_equal(got.astype(np.uint64), _ref_encode(q, x, np.random.default_rng(3), 9, noise))
    with pytest.raises(ValueError, match="non-finite"):
        q.encode(np.r_[x, np.inf], np.random.default_rng(3))


@pytest.mark.parametrize("bits", [20, 32, 40])
def test_a_nodes_masked_input_is_its_input_plus_the_reference_masks(bits):
    """A node's masked input is its encoded input plus its self mask plus, per neighbour j that
    shared keys, sign(i, j) times the pairwise mask, mod 2^b, with every mask from the reference PRG."""
    ids = [3, 5, 8, 13, 21]
    d = 300
    params = SecAggParams(threshold=0.6, clip=1.0, bits=bits, weight_max=4)
    srv = SecAggServer(ids, d, params)
    cs = {i: SecAggClient(i) for i in ids}
    keys = {i: cs[i].advertise(m) for i, m in srv.setup().items()}
    shares = {i: cs[i].share_keys(m) for i, m in srv.collect_keys(keys).items()}
    reqs = srv.collect_shares(shares)
    node = ids[1]
    st = cs[node].to_state()
    enc = cs[node].quantizer().encode(np.linspace(-1, 1, d), np.random.default_rng(0), weight=4)
    own_s = crypto.KeyPair(st["s_sk"])
    masks = [(st["seed"], 1)] + [(crypto.agree(own_s, pk, mask_info(st["round_id"])), pair_sign(node, j))
                                 for j, pk in zip(st["peer_ids"], st["peer_s"], strict=True)]
    got = cs[node].masked_input(reqs[node], enc)
    assert got.dtype == crypto.field_dtype(bits)
    np.testing.assert_array_equal(got.astype(np.uint64), _ref_masked(enc, masks, bits))
