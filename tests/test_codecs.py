"""What every codec shares: exactly representable inputs, batch/single equivalence, serialized
sizes, the Flower round trip, malformed payloads, configuration and the benchmark. The
families' oracles are in test_codecs_quant.py and test_codecs_sparse.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from flwr.app import Message
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.codecs import CODECS, decode_payload, describe_codecs, make_codec
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import message_nbytes, payload_from_records, payload_to_records

from tests.codec_oracles import (D, LAYOUT, PER_ROW_SEED, codec_for, randn, roundtrip)


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


@pytest.mark.parametrize("name", list(CODECS))
def test_a_seed_no_generator_takes_is_refused_by_name(name):
    """Seeds reach torch generators (row i of a batch: seed + i), which take [-2^63, 2^64 - 1]:
    beyond, a decode raised a bare ValueError ('Overflow when unpacking long long', found by
    scripts/fuzz on a randk payload from a swarm peer) instead of refusing the payload."""
    p = valid(name)
    k = p.meta["K"]
    for seed in (-(2**63) - 1, 2**64 - k + 1, 2**64, 10**30):
        with pytest.raises(PayloadError, match=f"seed {seed} is out of range"):
            make_codec(name).decode(with_meta(p, seed=seed), LAYOUT)
        with pytest.raises(ValueError, match=f"seed {seed} is out of range"):
            make_codec(name).encode(torch.from_numpy(randn(k)), LAYOUT, seed=seed)
    for seed in (-(2**63), 2**64 - k):  # the ends of the range still work
        x = torch.from_numpy(randn(k))
        q = make_codec(name).encode(x, LAYOUT, seed=seed)
        assert make_codec(name).decode(q, LAYOUT).shape == x.shape


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
    assert {(r["codec"], r["K"]) for r in rows} == {(c, k) for c in ["memcpy", "copy_", *CODECS] for k in (1, 64)}
    for r in rows:
        assert r["mb_per_s"] > 0 and r["vs_memcpy"] > 0 and r["vs_copy_"] > 0 and r["wire_bytes"] > 0 and r["runs"] >= 1
