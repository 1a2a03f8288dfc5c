"""Codecs against plain-numpy oracles, exactly representable inputs, serialized sizes,
malformed payloads and batch/single equivalence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Message
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.config import ConfigError
from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.kernels import bit_lut, pack_bits, random_subset, topk_abs_indices, unpack_bits
from fedswarm.algorithms.compression.codecs import CODECS, decode_payload, describe_codecs, make_codec
from fedswarm.algorithms.compression.countsketch import PRIME, CountSketch
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import message_nbytes, payload_from_records, payload_to_records

# A layout with matrices, a conv kernel, a scalar and biases; d = 106, not a multiple of 8.
LAYOUT = ParamLayout.from_shapes(
    [
        ("fc1.weight", (6, 5)),
        ("fc1.bias", (6,)),
        ("conv.weight", (4, 3, 2, 2)),
        ("scale", ()),
        ("fc2.weight", (3, 6)),
        ("fc2.bias", (3,)),
    ]
)
D = LAYOUT.d
# small-d settings that keep every codec non-trivial at d = 106
SMALL = {"topk": {"ratio": 0.05}, "randk": {"ratio": 0.1}, "qsgd": {"levels": 4, "bucket": 32},
         "countsketch": {"k_ratio": 0.1}}
PER_ROW_SEED = {"qsgd"}  # codecs whose row i uses seed + i; the rest share the seed


def randn(k: int, d: int = D, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, d)).astype(np.float32)


def codec_for(name: str, **extra):
    return make_codec(name, **{**SMALL.get(name, {}), **extra})


def roundtrip(codec, x: np.ndarray, layout=LAYOUT, seed: int = 0) -> tuple[Payload, np.ndarray]:
    payload = codec.encode(torch.from_numpy(x), layout, seed=seed)
    return payload, codec.decode(payload, layout).numpy()


def columns(layout):
    """(offset, rows, cols) of each tensor seen as a matrix."""
    for s in layout.specs:
        rows = s.shape[0] if s.shape else 1
        yield s.offset, rows, s.numel // rows


# -- numpy oracles: naive re-derivations, written without looking at the torch code -------


def np_onebit(x: np.ndarray, layout) -> np.ndarray:
    out = np.empty_like(x)
    for k in range(x.shape[0]):
        for off, rows, cols in columns(layout):
            m = x[k, off : off + rows * cols].reshape(rows, cols)
            q = np.empty_like(m)
            for j in range(cols):
                col = m[:, j].astype(np.float64)
                neg, pos = col[col < 0], col[col >= 0]
                a0 = neg.mean() if neg.size else 0.0
                a1 = pos.mean() if pos.size else 0.0
                for i in range(rows):
                    q[i, j] = a1 if col[i] >= 0 else a0
            out[k, off : off + rows * cols] = q.reshape(-1)
    return out


def np_sign(x: np.ndarray) -> np.ndarray:
    scale = np.abs(x.astype(np.float64)).sum(axis=1, keepdims=True) / x.shape[1]
    return np.where(x >= 0, scale, -scale).astype(np.float32)


def np_topk(x: np.ndarray, ratio: float) -> np.ndarray:
    k = math.ceil(ratio * x.shape[1] - 1e-9)
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        keep = np.argsort(-np.abs(x[r]), kind="stable")[:k]
        out[r, keep] = x[r, keep]
    return out


def np_fp16(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)


def np_qsgd_levels(x: np.ndarray, s: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """y = s·x/||bucket|| (float64) and the per-value norm."""
    y, norm = np.zeros(x.shape), np.zeros(x.shape)
    b = bucket or x.shape[1]
    for r in range(x.shape[0]):
        for start in range(0, x.shape[1], b):
            seg = x[r, start : start + b].astype(np.float64)
            n = np.sqrt((seg**2).sum())
            norm[r, start : start + b] = n
            y[r, start : start + b] = s * seg / n if n > 0 else 0.0
    return y, norm


def np_countsketch_hashes(d: int, coef: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket and sign of every coordinate from the coefficients, in exact Python ints."""
    rows = coef.shape[0]
    buckets, signs = np.zeros((rows, d), np.int64), np.zeros((rows, d), np.int64)
    for j in range(rows):
        a, b, c3, c2, c1, c0 = (int(v) for v in coef[j])
        for i in range(d):
            buckets[j, i] = ((a * i + b) % PRIME) % cols
            h = (c3 * i**3 + c2 * i**2 + c1 * i + c0) % PRIME
            signs[j, i] = -1 if h % 2 else 1
    return buckets, signs


def np_countsketch_decode(x: np.ndarray, buckets, signs, cols: int, k: int) -> np.ndarray:
    rows, d = buckets.shape
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        table = np.zeros((rows, cols))
        for j in range(rows):
            for i in range(d):
                table[j, buckets[j, i]] += signs[j, i] * float(x[r, i])
        est = np.array([np.sort([signs[j, i] * table[j, buckets[j, i]] for j in range(rows)])[(rows - 1) // 2]
                        for i in range(d)])
        keep = np.argsort(-np.abs(est), kind="stable")[:k]
        out[r, keep] = est[keep]
    return out


# -- kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 8, 9, 106, 1000])
def test_pack_bits_matches_numpy_little_bit_order(n):
    bits = torch.rand(3, n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = pack_bits(bits)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy(), axis=1, bitorder="little"))
    assert torch.equal(unpack_bits(packed, n, bit_lut(0.0, 1.0, "cpu")), bits.float())
    per_row = unpack_bits(packed, n, bit_lut(-torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0]), "cpu"))
    assert torch.equal(per_row, torch.where(bits, 1.0, -1.0) * torch.tensor([[1.0], [2.0], [3.0]]))


@pytest.mark.parametrize("k", [1, 5, 100, 1000, 12_000])
def test_topk_indices_sampled_path_is_exact(k):
    x = torch.from_numpy(randn(3, 100_000, seed=k))  # d >= 4·16384 takes the sampled path
    idx = topk_abs_indices(x, k)
    ref = np.sort(np.argsort(-np.abs(x.numpy()), axis=1, kind="stable")[:, :k], axis=1)
    np.testing.assert_array_equal(idx.numpy(), ref)


def test_topk_indices_fall_back_when_the_sample_misleads():
    from fedswarm.algorithms.compression.kernels import _sample_positions

    n, k = 100_000, 8000
    x = torch.full((2, n), 0.5)
    sample = _sample_positions(n, x.device)
    # the sampled coordinates are the only large ones, so the threshold sits at the
    # ~1800th largest value and fewer than k coordinates reach it
    x[0, sample] = 10.0 + torch.rand(sample.numel(), generator=torch.Generator().manual_seed(0))
    idx = topk_abs_indices(x, k)
    ref = x.abs().topk(k, dim=1).indices.sort(dim=1).values
    assert torch.equal(x.gather(1, idx).sort(dim=1).values, x.gather(1, ref).sort(dim=1).values)
    assert bool((idx[:, 1:] > idx[:, :-1]).all())


def test_topk_indices_with_ties_and_zeros():
    x = torch.zeros(2, 70_000)
    x[0, 5], x[1, 69_999] = 3.0, -2.0
    idx = topk_abs_indices(x, 10)  # the threshold is 0: every coordinate is a candidate
    assert idx.shape == (2, 10) and 5 in idx[0].tolist() and 69_999 in idx[1].tolist()
    assert bool((idx[:, 1:] > idx[:, :-1]).all())


def test_random_subset_is_uniform_and_reproducible():
    n, k, seeds = 50, 5, 4000
    counts = np.zeros(n)
    for s in range(seeds):
        idx = random_subset(n, k, s).numpy()
        assert len(set(idx.tolist())) == k and (np.diff(idx) > 0).all()
        counts[idx] += 1
    expected = seeds * k / n
    assert np.abs(counts - expected).max() < 6 * math.sqrt(expected)
    assert torch.equal(random_subset(10**6, 10**4, 3), random_subset(10**6, 10**4, 3))
    assert not torch.equal(random_subset(10**6, 10**4, 3), random_subset(10**6, 10**4, 4))
    big = random_subset(1000, 900, 1)  # the randperm path
    assert big.unique().numel() == 900


# -- decode(encode(x)) against the oracles ---------------------------------------------


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


def test_topk_matches_oracle():
    x = randn(3)
    payload, got = roundtrip(codec_for("topk"), x)
    np.testing.assert_array_equal(got, np_topk(x, 0.05))
    idx = payload.arrays["indices"].numpy()
    assert idx.dtype == np.int32 and (np.diff(idx, axis=1) > 0).all()


@pytest.mark.parametrize("unbiased", [False, True])
def test_randk_keeps_the_seeded_coordinates(unbiased):
    x = randn(3)
    codec = codec_for("randk", unbiased=unbiased)
    payload, got = roundtrip(codec, x, seed=11)
    k = math.ceil(0.1 * D)
    support = np.flatnonzero(got[0])
    assert len(support) == k and all((np.flatnonzero(row) == support).all() for row in got)  # shared
    scale = D / k if unbiased else 1.0
    np.testing.assert_allclose(got[:, support], x[:, support] * np.float32(scale), rtol=1e-6)
    np.testing.assert_array_equal(payload.arrays["values"].numpy(), x[:, support])
    other = np.flatnonzero(roundtrip(codec, x, seed=12)[1][0])
    assert not np.array_equal(other, support)
    assert codec.unbiased is unbiased and codec.error_feedback is not unbiased


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


def test_countsketch_codec_matches_oracle():
    codec = codec_for("countsketch", rows=3)
    x = randn(2)
    _, got = roundtrip(codec, x, seed=9)
    k = math.ceil(0.1 * D)
    cs = CountSketch(D, 3, 10 * k, seed=9)
    buckets, signs = np_countsketch_hashes(D, cs.coefficients.numpy(), 10 * k)
    np.testing.assert_allclose(got, np_countsketch_decode(x, buckets, signs, 10 * k, k), rtol=1e-5, atol=1e-6)


# -- inputs a codec represents exactly ---------------------------------------------------


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


def test_exact_inputs_of_each_codec():
    signs = np.where(randn(2) >= 0, 1, -1).astype(np.float32)
    x = signs * np.array([[0.5], [0.25]], np.float32)
    assert np.array_equal(roundtrip(make_codec("sign"), x)[1], x)

    sparse = np.zeros((2, D), np.float32)
    sparse[0, [3, 50, 105]] = [1.5, -2.0, 7.0]
    sparse[1, [0, 1, 2, 3, 4, 99]] = 1.0
    assert np.array_equal(roundtrip(codec_for("topk"), sparse)[1], sparse)  # k = 6

    x = randn(2)
    assert np.array_equal(roundtrip(make_codec("randk", ratio=1.0, unbiased=True), x)[1], x)

    levels = np.zeros((1, D), np.float32)
    levels[0, :4] = [3.0, 4.0, 12.0, 0.0]  # norm 13: with s = 13 every y_i is an integer
    assert np.array_equal(roundtrip(make_codec("qsgd", levels=13, bucket=0), levels, seed=3)[1], levels)

    half = randn(2).astype(np.float16).astype(np.float32)
    assert np.array_equal(roundtrip(make_codec("fp16"), half)[1], half)

    # a sketch far wider than d: in most rows no collisions, and the median ignores the rest
    assert np.array_equal(roundtrip(make_codec("countsketch", cols=100_000, k_ratio=1.0), x)[1], x)


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


# -- batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CODECS))
def test_batch_equals_separate_calls(name):
    codec = codec_for(name)
    x = torch.from_numpy(randn(4, seed=2))
    batch = codec.encode(x, LAYOUT, seed=7)
    dec = codec.decode(batch, LAYOUT)
    for i in range(4):
        single = codec.encode(x[i : i + 1], LAYOUT, seed=7 + i if name in PER_ROW_SEED else 7)
        for key, arr in single.arrays.items():
            assert torch.equal(arr, batch.arrays[key][i : i + 1]), key
        assert torch.equal(codec.decode(single, LAYOUT), dec[i : i + 1])
    assert dec.shape == (4, D) and dec.dtype == torch.float32 and dec.device == x.device


def test_topk_batch_on_the_sampled_path():
    layout = ParamLayout.from_shapes([("w", (1000, 100))])
    x = torch.from_numpy(randn(3, 100_000, seed=4))
    codec = make_codec("topk", ratio=0.001)
    dec = codec.decode(codec.encode(x, layout), layout).numpy()
    np.testing.assert_array_equal(dec, np_topk(x.numpy(), 0.001))


# -- the wire: serialized sizes and the Flower round trip --------------------------------


@pytest.fixture(autouse=True, scope="module")
def _task_identity():
    """Flower's Message() needs a task identity outside a running app; restore it after."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def as_message(payload: Payload) -> Message:
    return Message(payload_to_records(payload), dst_node_id=1, message_type="train")


@pytest.mark.parametrize("d", [100_000, 1_000_000])
@pytest.mark.parametrize("name", list(CODECS))
def test_serialized_size_matches_formula(name, d):
    layout = ParamLayout.from_shapes([("w", (d // 1000, 999)), ("b", (d // 1000,))])
    k = 2 if d == 100_000 else 1
    codec = make_codec(name)
    payload = codec.encode(torch.randn(k, d), layout, seed=1)
    measured = message_nbytes(as_message(payload))
    formula = codec.wire_bytes(layout, K=k)
    assert formula <= measured <= 1.05 * formula + 2048, (measured, formula)


def test_wire_formulas_by_hand():
    layout = ParamLayout.from_shapes([("w", (100, 30)), ("b", (100,))])  # d = 3100, 31 columns
    assert make_codec("onebit").wire_bytes(layout, K=2) == 2 * (388 + 8 * 31)
    assert make_codec("sign").wire_bytes(layout) == 388 + 4
    assert make_codec("topk", ratio=0.01).wire_bytes(layout) == 8 * 31
    assert make_codec("randk", ratio=0.01).wire_bytes(layout) == 4 * 31
    assert make_codec("qsgd").wire_bytes(layout) == 3100 + 4 * 7
    assert make_codec("qsgd", levels=200, bucket=0).wire_bytes(layout) == 2 * 3100 + 4
    assert make_codec("countsketch", k_ratio=0.01).wire_bytes(layout) == 4 * 5 * 310


@pytest.mark.parametrize("name", list(CODECS))
def test_flower_round_trip_decodes_the_same(name):
    codec = codec_for(name)
    payload = codec.encode(torch.from_numpy(randn(2)), LAYOUT, seed=3)
    received = payload_from_records(as_message(payload).content)
    assert torch.equal(decode_payload(received, LAYOUT), codec.decode(payload, LAYOUT))


# -- malformed payloads --------------------------------------------------------------------


def valid(name: str) -> Payload:
    return codec_for(name).encode(torch.from_numpy(randn(2)), LAYOUT, seed=3)


def with_arrays(p: Payload, **changes) -> Payload:
    arrays = {k: v.clone() for k, v in p.arrays.items()}
    for k, v in changes.items():
        if v is None:
            arrays.pop(k)
        else:
            arrays[k] = v
    return Payload(arrays, dict(p.meta))


def with_meta(p: Payload, **changes) -> Payload:
    meta = dict(p.meta)
    for k, v in changes.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    return Payload({k: v.clone() for k, v in p.arrays.items()}, meta)


def first_float(p: Payload) -> str:
    return next(k for k, v in p.arrays.items() if v.is_floating_point())


MUTATIONS = {
    "missing array": (lambda p: with_arrays(p, **{next(iter(p.arrays)): None}), "missing array"),
    "extra array": (lambda p: with_arrays(p, junk=torch.zeros(2, 3)), "unexpected array"),
    "wrong dtype": (lambda p: with_arrays(p, **{k: v.to(torch.float64) for k, v in list(p.arrays.items())[:1]}),
                    "dtype float64"),
    "wrong shape": (lambda p: with_arrays(p, **{k: v[..., :-1] for k, v in list(p.arrays.items())[:1]}), "shape"),
    "nan": (lambda p: with_arrays(p, **{first_float(p): p.arrays[first_float(p)].clone().fill_(float("nan"))}),
            "non-finite"),
    "missing meta": (lambda p: with_meta(p, d=None), "missing d"),
    "extra meta": (lambda p: with_meta(p, extra=1), "unexpected keys extra"),
    "other codec": (lambda p: with_meta(p, codec="zip"), "'codec' is 'zip'"),
    "other d": (lambda p: with_meta(p, d=D + 1), "d=106"),
    "float K": (lambda p: with_meta(p, K=2.0), "'K' must be an int"),
    "K mismatch": (lambda p: with_meta(p, K=3), "expected [3"),
    "not a payload": (lambda p: p.arrays, "expected a Payload"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("name", list(CODECS))
def test_malformed_payloads_are_rejected(name, mutation):
    mutate, message = MUTATIONS[mutation]
    with pytest.raises(PayloadError, match=message.replace("[", r"\[")):
        make_codec(name).decode(mutate(valid(name)), LAYOUT)


@pytest.mark.parametrize("name", list(CODECS))
def test_nan_is_rejected_on_the_wire_too(name):
    p = valid(name)
    key = first_float(p)
    bad = with_arrays(p, **{key: p.arrays[key].clone().fill_(float("inf"))})
    with pytest.raises(PayloadError, match="non-finite"):
        decode_payload(payload_from_records(as_message(bad).content), LAYOUT)


@pytest.mark.parametrize(
    "name, key, value, message",
    [
        ("topk", "ratio", 0.0, "topk.ratio"),
        ("qsgd", "levels", 0, "qsgd.levels"),
        ("countsketch", "rows", 2.5, "countsketch.rows"),
        ("randk", "unbiased", 1, "randk.unbiased"),
    ],
)
def test_meta_hyperparameters_are_checked(name, key, value, message):
    with pytest.raises(PayloadError, match=message):
        make_codec(name).decode(with_meta(valid(name), **{key: value}), LAYOUT)


def test_codec_specific_corruptions():
    p = valid("topk")
    idx = p.arrays["indices"]
    for bad, message in [
        (idx.clone().fill_(D), r"lie in \[0, 106\)"),
        (idx - idx[:, :1] - 1, r"lie in \[0, 106\)"),
        (idx[:, [0, 0, 1, 2, 3, 4]], "strictly increasing"),
        (idx.flip(1), "strictly increasing"),
    ]:
        with pytest.raises(PayloadError, match=message):
            make_codec("topk").decode(with_arrays(p, indices=bad.contiguous()), LAYOUT)

    q = make_codec("qsgd", levels=127).encode(torch.from_numpy(randn(2)), LAYOUT)
    codes = q.arrays["codes"].clone()
    codes[0, 0] = -128  # abs(-128) overflows int8: the range check must not use abs
    with pytest.raises(PayloadError, match="codes"):
        make_codec("qsgd").decode(with_arrays(q, codes=codes), LAYOUT)
    p = valid("qsgd")
    with pytest.raises(PayloadError, match="codes"):
        make_codec("qsgd").decode(with_arrays(p, codes=p.arrays["codes"].clone().fill_(5)), LAYOUT)
    with pytest.raises(PayloadError, match="norms"):
        make_codec("qsgd").decode(with_arrays(p, norms=-p.arrays["norms"] - 1), LAYOUT)

    p = valid("onebit")
    with pytest.raises(PayloadError, match="means"):
        make_codec("onebit").decode(with_arrays(p, means=p.arrays["means"].flip(2).contiguous()), LAYOUT)
    p = valid("sign")
    with pytest.raises(PayloadError, match="scale"):
        make_codec("sign").decode(with_arrays(p, scale=-p.arrays["scale"] - 1), LAYOUT)


def test_numpy_payloads_are_checked_too():
    p = payload_from_records(as_message(valid("topk")).content)
    good = make_codec("topk").decode(p, LAYOUT)
    assert good.shape == (2, D)
    bad = Payload({**p.arrays, "values": p.arrays["values"].astype(">f4")}, p.meta)
    with pytest.raises(PayloadError, match="dtype >f4"):
        make_codec("topk").decode(bad, LAYOUT)
    bad = Payload({**p.arrays, "values": p.arrays["values"].tolist()}, p.meta)
    with pytest.raises(PayloadError, match="not an array"):
        make_codec("topk").decode(bad, LAYOUT)
    with pytest.raises(PayloadError, match="known codecs"):
        decode_payload(Payload(p.arrays, {**p.meta, "codec": "gzip"}), LAYOUT)


def test_decode_does_not_alias_the_payload():
    codec = make_codec("none")
    p = codec.encode(torch.ones(1, D), LAYOUT)
    codec.decode(p, LAYOUT).zero_()
    assert bool((p.arrays["values"] == 1).all())


# -- construction and description ---------------------------------------------------------


def test_make_codec_rejects_bad_configuration():
    with pytest.raises(ConfigError, match="unknown codec 'gzip'"):
        make_codec("gzip")
    with pytest.raises(ConfigError, match="unknown parameter 'k' for codec 'topk'"):
        make_codec("topk", k=10)
    for name, params, where in [
        ("topk", {"ratio": 1.5}, "topk.ratio"),
        ("qsgd", {"levels": 40_000}, "qsgd.levels"),
        ("countsketch", {"rows": 0}, "countsketch.rows"),
    ]:
        with pytest.raises(ConfigError, match=where):
            make_codec(name, **params)


def test_encode_rejects_bad_input():
    codec = make_codec("sign")
    with pytest.raises(ValueError, match="d=106"):
        codec.encode(torch.zeros(1, D + 1), LAYOUT)
    with pytest.raises(ValueError, match=r"\[K, d\]"):
        codec.encode(torch.zeros(D), LAYOUT)


def test_every_codec_is_described():
    rows = {r["name"]: r for r in describe_codecs()}
    assert set(rows) == set(CODECS)
    for name, cls in CODECS.items():
        doc = cls.__doc__ or ""
        assert "Wire" in doc and "Paper" in doc or name in ("none", "fp16"), name
        assert rows[name]["description"]
        for h in rows[name]["hyperparams"]:
            assert h["help"] and h["allowed"]
    assert [r["name"] for r in describe_codecs() if r["error_feedback"]] == ["onebit", "sign", "topk", "randk",
                                                                             "countsketch"]
    assert [r["name"] for r in describe_codecs() if r["unbiased"]] == ["none", "qsgd"]


def test_bench_codecs_writes_its_table(tmp_path):
    from fedswarm.bench.codecs import benchmark_layout, run

    assert benchmark_layout(10**6).d == 10**6 and benchmark_layout(1000).d == 1000
    rows = run(tmp_path, quick=True, sizes=[5000])
    assert (tmp_path / "codecs.json").exists() and (tmp_path / "codecs.png").stat().st_size > 0
    assert {(r["codec"], r["K"]) for r in rows} == {(c, k) for c in ["memcpy", *CODECS] for k in (1, 64)}
    for r in rows:
        assert r["mb_per_s"] > 0 and r["vs_memcpy"] > 0 and r["wire_bytes"] > 0 and r["runs"] >= 1
