"""Quantizing codecs (none, fp16, onebit, sign, qsgd) and the bit-packing kernels against
plain-numpy oracles and exactly representable inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.kernels import bit_lut, lut_decode, pack_bits, sign_bits, unpack_bits, unpack_bool
from fedswarm.algorithms.compression.codecs import make_codec

from tests.codec_oracles import (D, LAYOUT, codec_for, columns, np_fp16, np_onebit, np_qsgd_levels, np_sign, randn,
                                  roundtrip)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 106, 1000])
def test_pack_bits_matches_numpy_little_bit_order(n):
    bits = torch.rand(3, n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = pack_bits(bits)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy(), axis=1, bitorder="little"))
    assert torch.equal(unpack_bits(packed, n, bit_lut(0.0, 1.0, "cpu")), bits.float())
    per_row = unpack_bits(packed, n, bit_lut(-torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0]), "cpu"))
    assert torch.equal(per_row, torch.where(bits, 1.0, -1.0) * torch.tensor([[1.0], [2.0], [3.0]]))


def test_none_and_fp16_match_oracle():
    x = randn(3) * np.float32(1000)
    x[0, 0], x[1, 1] = 1e6, -1e6  # beyond float16: saturates
    assert np.array_equal(roundtrip(make_codec("none"), x)[1], x)
    assert np.array_equal(roundtrip(make_codec("fp16"), x)[1], np_fp16(x))


def test_onebit_matches_oracle():
    x = randn(3)
    x[1, 36 : 36 + 48] = np.abs(x[1, 36 : 36 + 48])  # a tensor with no negatives at all
    payload, got = roundtrip(make_codec("onebit"), x)
    np.testing.assert_allclose(got, np_onebit(x, LAYOUT), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(payload.arrays["bits"].numpy(), np.packbits(x >= 0, axis=1, bitorder="little"))
    assert payload.arrays["means"].shape == (3, 5 + 1 + 12 + 1 + 6 + 1, 2)


def test_sign_matches_oracle():
    x = randn(3)
    x[0, :10] = 0.0  # sign(0) = +1
    np.testing.assert_allclose(roundtrip(make_codec("sign"), x)[1], np_sign(x), rtol=1e-6)


def test_qsgd_codes_round_to_a_neighbouring_level():
    s, bucket = 4, 32
    x = randn(3)
    payload, got = roundtrip(codec_for("qsgd"), x, seed=5)
    y, norm = np_qsgd_levels(x, s, bucket)
    codes = payload.arrays["codes"].numpy().astype(np.float64)
    assert payload.arrays["codes"].dtype == torch.int8
    assert ((codes == np.floor(y)) | (codes == np.floor(y) + 1) | (np.abs(codes - y) < 1e-5)).all()
    np.testing.assert_allclose(payload.arrays["norms"].numpy(), norm[:, ::bucket], rtol=1e-6)
    np.testing.assert_allclose(got, norm / s * codes, rtol=1e-6, atol=1e-7)


def test_qsgd_int16_codes_above_127_levels():
    x = randn(2)
    x[:, 0] = 100.0  # dominates the norm: its code is near 300
    payload, _ = roundtrip(make_codec("qsgd", levels=300), x)
    assert payload.arrays["codes"].dtype == torch.int16
    assert int(payload.arrays["codes"].abs().max()) > 127


def test_onebit_two_valued_columns_are_exact():
    rng = np.random.default_rng(1)
    x = np.zeros((2, D), np.float32)
    for k in range(2):
        for off, rows, cols in columns(LAYOUT):
            for j in range(cols):
                hi = np.float32(rng.uniform(0, 3))
                lo = np.float32(-rng.uniform(1e-3, 3))
                pick = rng.random(rows) < 0.5
                x[k, off + j : off + rows * cols : cols] = np.where(pick, hi, lo)
    x[0, :30] = np.float32(0.1)  # one-sided and a non-dyadic value repeated 6 times per column
    assert np.array_equal(roundtrip(make_codec("onebit"), x)[1], x)


def test_qsgd_is_unbiased():
    n, s = 4000, 4
    x = torch.from_numpy(randn(1, 64, seed=3))
    batch = x.expand(n, 64).contiguous()  # row i draws its noise from seed + i
    codec = make_codec("qsgd", levels=s, bucket=0)
    layout = ParamLayout.from_shapes([("v", (64,))])
    dec = codec.decode(codec.encode(batch, layout, seed=100), layout)
    assert dec.std(dim=0).max() > 0  # it is random
    step = float(torch.linalg.vector_norm(x)) / s  # distance between two levels
    bound = 6 * (step / 2) / math.sqrt(n)  # 6 sigma of the mean (variance <= step^2/4)
    assert float((dec.mean(dim=0) - x[0]).abs().max()) < bound
    # the bound is tight enough to catch a biased rounding (round to nearest)
    nearest = torch.round(x * s / float(torch.linalg.vector_norm(x))) * step
    assert float((nearest - x).abs().max()) > bound


def test_qsgd_noise_depends_on_seed_only():
    x = torch.from_numpy(randn(1))
    codec = codec_for("qsgd")
    a, b, c = (codec.encode(x, LAYOUT, seed=s).arrays["codes"] for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("n", [1, 7, 8, 106, 1000])
def test_numpy_bit_kernels_equal_the_torch_ones(n):
    """The CPU fast paths (numpy packbits/unpackbits/take) against the torch kernels."""
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    x[0, : min(n, 3)] = torch.tensor([0.0, -0.0, 1.0])[: min(n, 3)]  # >= 0 holds for -0.0 too
    packed = sign_bits(x)
    assert torch.equal(packed, pack_bits(x >= 0))
    assert torch.equal(unpack_bool(packed, n), x >= 0)
    scale = torch.tensor([1.0, 2.0, 3.0])
    lut = bit_lut(-scale, scale, "cpu")
    got = lut_decode(packed, n, lut)
    assert got.is_contiguous() and torch.equal(got, unpack_bits(packed, n, lut))
    assert torch.equal(lut_decode(packed, n, bit_lut(0.0, 1.0, "cpu")), (x >= 0).float())
