"""1-bit SGD's scale granularity: per column (CNTK), per tensor, and auto."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.params import ParamLayout
from fedswarm.tasks.staged import cnn4

# digits-cnn4's shapes: short conv columns (8 to 64 rows), norms, a 10-row output layer
CNN4 = ParamLayout.from_shapes([(n, tuple(p.shape)) for n, p in cnn4(1, 10).named_parameters()])
# a tall layer (512 rows per column) beside a short one
MIXED = ParamLayout.from_shapes([("w1", (512, 6)), ("b1", (512,)), ("w2", (3, 512)), ("b2", (3,))])


def np_onebit_groups(x: np.ndarray, layout, group_of) -> np.ndarray:
    """Oracle: ``group_of(shape)`` gives 'column', 'tensor' or an int g (g consecutive
    matrix columns); each group gets the mean of its negatives and of its non-negatives."""
    out = np.empty_like(x)
    for k in range(x.shape[0]):
        for s in layout.specs:
            v = x[k, s.offset:s.offset + s.numel].astype(np.float64)
            rows = s.shape[0] if s.shape else 1
            how = group_of(s.shape)
            m = v.reshape(-1, 1) if how == "tensor" else v.reshape(rows, -1)
            g = how if isinstance(how, int) else 1
            q = np.empty_like(m)
            for j0 in range(0, m.shape[1], g):
                blk = m[:, j0:j0 + g]
                a0 = blk[blk < 0].mean() if (blk < 0).any() else 0.0
                a1 = blk[blk >= 0].mean() if (blk >= 0).any() else 0.0
                q[:, j0:j0 + g] = np.where(blk >= 0, a1, a0)
            out[k, s.offset:s.offset + s.numel] = q.reshape(-1)
    return out


def roundtrip(codec, x, layout):
    p = codec.encode(torch.from_numpy(x), layout, seed=0)
    return p, codec.decode(p, layout).numpy()


@pytest.mark.parametrize("scale,group_of", [
    ("column", lambda shape: "column"),
    ("tensor", lambda shape: "tensor"),
    ("auto", lambda shape: "column" if shape[0] >= 256 else "tensor"),
    ("block", lambda shape: 1 if shape[0] >= 256 else -(-256 // shape[0])),
])
def test_onebit_scale_matches_oracle(scale, group_of):
    x = np.random.default_rng(3).standard_normal((2, MIXED.d)).astype(np.float32)
    p, got = roundtrip(make_codec("onebit", scale=scale), x, MIXED)
    np.testing.assert_allclose(got, np_onebit_groups(x, MIXED, group_of), rtol=1e-6, atol=1e-7)
    groups = {"column": 6 + 1 + 512 + 1, "tensor": 4, "auto": 6 + 1 + 1 + 1, "block": 6 + 1 + 6 + 1}[scale]
    assert p.arrays["means"].shape == (2, groups, 2)
    assert p.meta["scale"] == scale


def test_onebit_wire_on_small_layers():
    """The fix: per column, digits-cnn4's scales cost more than its bits (12.9x less than
    float32 before framing); per tensor (auto, on these short columns) it is ~31x."""
    d = CNN4.d
    per_column = make_codec("onebit").wire_bytes(CNN4)
    auto = make_codec("onebit", scale="auto").wire_bytes(CNN4)
    assert 4 * d / per_column < 13.0
    assert auto == (d + 7) // 8 + 8 * len(CNN4.specs)
    assert 4 * d / auto > 30.0
    block = make_codec("onebit", scale="block").wire_bytes(CNN4)
    assert auto < block and 4 * d / block > 20.0  # finer than a tensor, still <= 0.25 bit per value of scales


def test_onebit_strategy_defaults_to_auto_scale():
    from fedswarm.strategies.federated.compressed_fedavg import OneBitSGD

    s = OneBitSGD(CNN4)
    assert s.codec.params["scale"] == "auto" and s.downlink.params["scale"] == "auto"
    assert OneBitSGD(CNN4, scale="column").codec.params["scale"] == "column"


def test_onebit_rejects_unknown_scale():
    with pytest.raises(Exception, match="scale"):
        make_codec("onebit", scale="row")
