"""Sparsifying codecs: top-k, random-k and Count Sketch."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from fedswarm.algorithms.compression import native
from fedswarm.algorithms.compression.base import Codec
from fedswarm.params import all_finite
from fedswarm.hyperparams import HyperParam
from fedswarm.algorithms.compression.kernels import out_buffer, random_subset, topk_abs_indices
from fedswarm.algorithms.compression.countsketch import CountSketch

__all__ = ["TopKCodec", "RandKCodec", "CountSketchCodec", "k_of"]


def k_of(ratio: float, d: int) -> int:
    """k = ceil(ratio·d) in [1, d] (rounded first so that 0.01·10^5 is 1000, not 1001)."""
    return max(1, min(d, math.ceil(round(ratio * d, 6))))


def _scatter(k: int, d: int, idx: torch.Tensor, vals: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``[K, d]`` zeros with ``vals`` at ``idx`` (``[K, m]``, in range) into ``out`` or a fresh
    tensor; on a CPU a C loop that streams the zeros of a large output (see ``fs_scatter_dense``)."""
    so = native.lib() if vals.device.type == "cpu" and vals.dtype == torch.float32 else None
    if so is None:
        return out_buffer(out, k, d, vals.device, zero=True).scatter_(1, idx, vals)
    buf = out_buffer(out, k, d, vals.device)
    idx, vals = idx.to(torch.int64).contiguous(), vals.contiguous()
    m = idx.shape[1]
    for i in range(k):
        so.fs_scatter_dense(native.ptr(buf, i * d), d, native.ptr(idx, i * m), native.ptr(vals, i * m), m)
    return buf


class TopKCodec(Codec):
    """Top-k sparsification: the k = ceil(ratio·d) values of largest magnitude per client.

    ``Q(x)_i = x_i if i in top-k(|x|) else 0``. Biased; with error feedback the unsent
    mass is carried to later rounds (Stich, Cordonnier, Jaggi 2018) and it converges like
    SGD at 1% density or less. Ties at the k-th magnitude are broken arbitrarily.

    Wire: 8·K·k bytes: ``values`` float32 [K, k] and ``indices`` int32 [K, k], strictly
    increasing per client (decode checks it, so duplicates cannot be smuggled in).

    Paper: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP
    2017; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
    """

    name = "topk"
    paper = "Aji & Heafield, EMNLP 2017; Stich et al., NeurIPS 2018"
    hyperparams = (HyperParam("ratio", 0.01, "fraction of coordinates sent, k = ceil(ratio·d)", gt=0.0, le=1.0),)

    def _encode(self, x, layout, seed):
        idx = topk_abs_indices(x, k_of(self.params["ratio"], layout.d))
        return {"values": x.gather(1, idx), "indices": idx.to(torch.int32)}

    def _array_specs(self, k, layout, params):
        n = k_of(params["ratio"], layout.d)
        return {"values": (torch.float32, (k, n)), "indices": (torch.int32, (k, n))}

    def _decode(self, arrays, k, layout, params, seed, out):
        idx = arrays["indices"]
        lo, hi = torch.aminmax(idx)
        if int(lo) < 0 or int(hi) >= layout.d:
            raise self._fail(f"'indices' must lie in [0, {layout.d}), got [{int(lo)}, {int(hi)}]")
        if idx.shape[1] > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise self._fail("'indices' must be strictly increasing per client")
        return _scatter(k, layout.d, idx.to(torch.int64), arrays["values"], out)

    def wire_bytes(self, layout, K=1):
        return 8 * K * k_of(self.params["ratio"], layout.d)


class RandKCodec(Codec):
    """Random-k sparsification: k = ceil(ratio·d) coordinates drawn from a shared seed.

    ``Q(x)_i = c·x_i if i in S(seed) else 0``, with S a uniform k-subset of [d] regenerated
    by the receiver from ``meta['seed']`` (no indices travel) and c = d/k if ``unbiased``
    else 1. All clients (all rows of a batch) given the same seed send the same
    coordinates, so their payloads can be summed directly (all-reduce compatible).
    Unbiased with c = d/k (variance grows as d/k); leave the scale off when using error
    feedback, which then carries the unsent coordinates.

    Wire: 4·K·k bytes: ``values`` float32 [K, k] (unscaled).

    Paper: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
    Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed
    Optimization", NeurIPS 2018.
    """

    name = "randk"
    linear = True  # the coordinates come from the round's seed, the same on every node
    paper = "Stich et al., NeurIPS 2018"
    hyperparams = (
        HyperParam("ratio", 0.01, "fraction of coordinates sent, k = ceil(ratio·d)", gt=0.0, le=1.0),
        HyperParam("unbiased", False, "scale by d/k so that E[decode] = x (off for error feedback)"),
    )

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return bool(self.params["unbiased"])

    @property
    def error_feedback(self) -> bool:  # type: ignore[override]
        return not self.unbiased

    def _encode(self, x, layout, seed):
        idx = random_subset(layout.d, k_of(self.params["ratio"], layout.d), seed, x.device)
        return {"values": x.index_select(1, idx)}

    def _array_specs(self, k, layout, params):
        return {"values": (torch.float32, (k, k_of(params["ratio"], layout.d)))}

    def _decode(self, arrays, k, layout, params, seed, out):
        vals = arrays["values"]
        n = vals.shape[1]
        idx = random_subset(layout.d, n, seed, vals.device)
        if params["unbiased"]:
            vals = vals * (layout.d / n)
            if not all_finite(vals):  # finite values near float32's max overflow when scaled up by d/k
                raise self._fail(f"values overflow float32 when scaled by d/k = {layout.d / n:g}")
        return _scatter(k, layout.d, idx.expand(k, n), vals, out)

    def wire_bytes(self, layout, K=1):
        return 4 * K * k_of(self.params["ratio"], layout.d)


@functools.lru_cache(maxsize=2)
def _sketcher(d: int, rows: int, cols: int, seed: int, device: torch.device) -> CountSketch:
    # the hash parameters are small (r·(d/c + 2c) values), but cheap to keep: the last two
    return CountSketch(d, rows, cols, seed, device)


class CountSketchCodec(Codec):
    """Count Sketch compression with heavy-hitter decoding (sketched top-k).

    Encode: the r x c Count Sketch S(x) of each client's vector (hashes from ``seed``; see
    :mod:`fedswarm.algorithms.compression.countsketch`). Decode: the k = ceil(k_ratio·d) coordinates
    with the largest estimate ``|x̂_i| = |median_j s_j(i)·S[j, h_j(i)]|``, set to their
    estimates, zeros elsewhere. Sketches are linear, so a server may sum the tables of
    clients that share the seed before decoding. Biased (collisions, top-k): pair it with
    error feedback, or keep momentum and error in sketch space on the server (FetchSGD).

    ``cols = 0`` picks c = 10·k, the column-to-k ratio of FetchSGD's experiments.

    Wire: 4·K·r·c bytes: ``table`` float32 [K, rows, cols]; independent of d.

    Paper: Charikar, Chen, Farach-Colton, ICALP 2002 (Count Sketch); Ivkin et al.,
    "Communication-efficient Distributed SGD with Sketching", NeurIPS 2019; Rothchild et
    al., "FetchSGD", ICML 2020.
    """

    name = "countsketch"
    linear = True  # the sketch of a sum is the sum of the sketches (same hashes from the round seed)
    paper = "Ivkin et al., NeurIPS 2019; Rothchild et al., ICML 2020"
    hyperparams = (
        HyperParam("rows", 5, "sketch rows r (independent hash functions)", ge=1, le=64),
        HyperParam("cols", 0, "sketch columns c (0: 10·k)", ge=0),
        HyperParam("k_ratio", 0.001, "fraction of coordinates decoded, k = ceil(k_ratio·d)", gt=0.0, le=1.0),
    )

    @staticmethod
    def _dims(d: int, params: dict[str, Any]) -> tuple[int, int, int]:
        k = k_of(params["k_ratio"], d)
        return params["rows"], params["cols"] or 10 * k, k

    def _encode(self, x, layout, seed):
        rows, cols, _ = self._dims(layout.d, self.params)
        return {"table": _sketcher(layout.d, rows, cols, seed, x.device).sketch(x)}

    def _array_specs(self, k, layout, params):
        rows, cols, _ = self._dims(layout.d, params)
        return {"table": (torch.float32, (k, rows, cols))}

    def _decode(self, arrays, k, layout, params, seed, out):
        table = arrays["table"]
        rows, cols, n = self._dims(layout.d, params)
        sketch = _sketcher(layout.d, rows, cols, seed, table.device)
        idx, vals = sketch.unsketch(table, n)
        return _scatter(k, layout.d, idx, vals, out)

    def wire_bytes(self, layout, K=1):
        rows, cols, _ = self._dims(layout.d, self.params)
        return 4 * K * rows * cols
