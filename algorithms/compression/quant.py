"""Quantizing codecs: float32 passthrough, fp16, 1-bit SGD, scaled sign, QSGD."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.base import Codec
from fedswarm.hyperparams import HyperParam
from fedswarm.algorithms.compression import native
from fedswarm.algorithms.compression.kernels import bit_lut, lut_decode, out_buffer, sign_bits

__all__ = ["NoneCodec", "Fp16Codec", "OneBitCodec", "SignCodec", "QSGDCodec"]

_FP16_MAX = 65504.0


def _acc_dtype(device: torch.device) -> torch.dtype:
    # Column sums in float64 make the mean of a constant column exact (n*v is exact in
    # 53 bits for n < 2^29); Apple's MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


class NoneCodec(Codec):
    """No compression: the float32 vector as is.

    decode(encode(x)) = x. Wire: 4·K·d bytes. The baseline every codec is compared with.
    """

    name = "none"
    unbiased = True
    error_feedback = False
    linear = True

    def _encode(self, x, layout, seed):
        return {"values": x.clone()}

    def _array_specs(self, k, layout, params):
        return {"values": (torch.float32, (k, layout.d))}

    def _decode(self, arrays, k, layout, params, seed, out):
        if out is not None:
            return out.copy_(arrays["values"])
        return arrays["values"].clone()  # never alias the payload

    def wire_bytes(self, layout, K=1):
        return 4 * K * layout.d


class Fp16Codec(Codec):
    """Half precision: each value rounded to IEEE float16 (values beyond ±65504 saturate).

    decode(encode(x)) = float32(float16(clamp(x, ±65504))): relative error <= 2^-11 in the
    normal range, so error feedback is rarely worth it. Wire: 2·K·d bytes. As torch's
    ``fp16_compress_hook`` (DDP communication hooks).
    """

    name = "fp16"
    unbiased = False
    error_feedback = False

    def _encode(self, x, layout, seed):
        return {"values": x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)}

    def _array_specs(self, k, layout, params):
        return {"values": (torch.float16, (k, layout.d))}

    def _decode(self, arrays, k, layout, params, seed, out):
        return arrays["values"].to(torch.float32) if out is None else out.copy_(arrays["values"])

    def wire_bytes(self, layout, K=1):
        return 2 * K * layout.d


# ``scale="auto"``: a tensor keeps CNTK's per-column pairs only when its columns have at
# least this many rows (64 bits of scales per column cost <= 0.25 bit per value there);
# ``scale="block"``: consecutive columns are grouped until a group holds this many values.
AUTO_MIN_ROWS = 256


def _scale_shape(spec, scale: str) -> tuple[int, int, int]:
    """``(rows, cols, g)``: the tensor viewed as ``rows x cols``, and ``g`` consecutive
    columns sharing one (a0, a1) pair (``ceil(cols / g)`` pairs). ``column``: g = 1 on
    the tensor's matrix columns; ``tensor``: the whole tensor is one column; ``auto``:
    columns if they have at least ``AUTO_MIN_ROWS`` rows, else the whole tensor;
    ``block``: g = ceil(AUTO_MIN_ROWS / rows) columns (one column when it is that tall)."""
    rows, cols = spec.matrix_shape
    if scale == "column" or (scale == "auto" and rows >= AUTO_MIN_ROWS):
        return rows, cols, 1
    if scale == "block":
        return rows, cols, min(cols, -(-AUTO_MIN_ROWS // rows))
    return spec.numel, 1, 1


def _columns(layout: ParamLayout, scale: str = "column") -> int:
    """Number of (a0, a1) pairs (cached per layout, as :func:`_plan`)."""
    return _columns_of(layout.specs, scale)


def _columns_of(specs, scale: str) -> int:
    _, _, cols, groups = _plan_of(specs, scale)
    return sum(-(-c // g) for c, g in zip(cols.tolist(), groups, strict=True))


def _group_sum(t: torch.Tensor, g: int) -> torch.Tensor:
    """``[k, cols]`` per-column sums to ``[k, ceil(cols / g)]`` per-group sums."""
    if g == 1:
        return t
    k, cols = t.shape
    n = -(-cols // g)
    return torch.nn.functional.pad(t, (0, n * g - cols)).view(k, n, g).sum(2)


def _plan(layout: ParamLayout, scale: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Each tensor's offset, rows and columns (int64 tensors, for the C loops) and group
    width, as :func:`_scale_shape` sees them; cached per layout (do not modify)."""
    return _plan_of(layout.specs, scale)


@functools.lru_cache(maxsize=16)
def _plan_of(specs, scale: str):
    shapes = [(spec.offset, *_scale_shape(spec, scale)) for spec in specs]
    off, rows, cols = (torch.tensor([s[i] for s in shapes], dtype=torch.int64) for i in range(3))
    return off, rows, cols, tuple(s[3] for s in shapes)


def _means(s_pos: torch.Tensor, s_neg: torch.Tensor, n_pos: torch.Tensor, n_all: torch.Tensor) -> torch.Tensor:
    """``[K, C, 2]`` float32 (mean of the negatives, mean of the non-negatives) per pair,
    from the sums and counts (an empty side gives 0)."""
    nneg = n_all.unsqueeze(0) - n_pos
    hi = s_pos / n_pos.clamp(min=1)
    lo = s_neg / nneg.clamp(min=1)
    return torch.stack([lo, hi], dim=2).to(torch.float32)


class OneBitCodec(Codec):
    """1-bit SGD: one bit per value and two reconstruction values per column.

    For column j of every weight matrix (``TensorSpec.matrix_shape``: a Linear ``[out, in]``
    has ``in`` columns of ``out`` rows, a conv ``[out, in, kh, kw]`` has ``in·kh·kw``; a bias
    or other vector is one column), with threshold 0 (CNTK's default)::

        b_i = [v_i >= 0]
        a0_j = mean{v_i : b_i = 0},  a1_j = mean{v_i : b_i = 1}     (an empty side gives 0)
        Q(v)_i = a1_j if b_i else a0_j

    The means are the MSE-optimal values for the fixed threshold; a column holding one
    value >= 0 and one value < 0 is reproduced exactly (sums are taken in float64).
    Biased: pair it with error feedback, as the paper does.

    Wire: bits are packed 8 per byte over the whole flat vector (element i is bit i % 8 of
    byte i // 8, not padded per column) plus a float32 (a0, a1) pair per column:
    K·(ceil(d/8) + 8·C) bytes, C = total number of columns -- about 32x smaller than
    float32 for wide matrices. Arrays: ``bits`` uint8 [K, ceil(d/8)], ``means`` float32
    [K, C, 2] (mean of the negatives, mean of the non-negatives).

    ``scale``: which values share a pair. ``column`` (default) is CNTK's, built for
    speech DNNs with columns of thousands of rows; on small layers it costs more than the
    bits (a conv ``[8, 1, 3, 3]`` has 9 columns of 8 rows: 64 bits of scales per 8 bits of
    signs, capping digits-cnn4 at 11.9x). ``tensor``: one pair per tensor (C = number of
    tensors). ``auto``: columns where they have >= 256 rows, else the tensor (the
    ``onebit`` strategy's default). ``block``: consecutive columns grouped until a group
    holds >= 256 values (ceil(256/rows) columns; finer than a tensor, <= 0.25 bit/value).

    Paper: Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014;
    quantizer as in CNTK's ``ColumnQuantizer``.
    """

    name = "onebit"
    paper = "Seide et al., Interspeech 2014"
    hyperparams = (
        HyperParam("scale", "column", "values sharing one (a0, a1) pair: column (CNTK), tensor, auto "
                   "(columns of >= 256 rows, else the whole tensor) or block (consecutive columns grouped to "
                   ">= 256 values)", choices=("column", "tensor", "auto", "block")),
    )

    def _encode(self, x, layout, seed):
        k = x.shape[0]
        acc = _acc_dtype(x.device)
        so = native.lib() if x.device.type == "cpu" else None
        if so is not None:
            return self._encode_native(so, x.contiguous(), layout)
        s_pos, s_neg, n_pos, n_all = [], [], [], []
        xn = x.numpy() if x.device.type == "cpu" else None
        for spec in layout.specs:  # reductions per tensor: each has its own column stride
            rows, cols, g = _scale_shape(spec, self.params["scale"])
            sl = slice(spec.offset, spec.end)
            if xn is not None:  # numpy's buffered casting sums in float64 without a float64 copy
                xt = xn[:, sl].reshape(k, rows, cols)
                sp = torch.from_numpy(np.maximum(xt, 0).sum(1, dtype=np.float64))
                sn = torch.from_numpy(np.minimum(xt, 0).sum(1, dtype=np.float64))
                cnt = torch.from_numpy(np.count_nonzero(xt >= 0, axis=1).astype(np.int32))
            else:
                xt = x[:, sl].view(k, rows, cols)
                sp, sn = xt.clamp(min=0).sum(1, dtype=acc), xt.clamp(max=0).sum(1, dtype=acc)
                cnt = (xt >= 0).sum(1, dtype=torch.int32)
            s_pos.append(_group_sum(sp, g))
            s_neg.append(_group_sum(sn, g))
            n_pos.append(_group_sum(cnt, g))
            n_all.append(_group_sum(torch.full((1, cols), rows, dtype=torch.int32, device=x.device), g)[0])
        return {"bits": sign_bits(x), "means": _means(torch.cat(s_pos, 1), torch.cat(s_neg, 1), torch.cat(n_pos, 1),
                                                      torch.cat(n_all))}

    def _encode_native(self, so, x, layout):
        """One C pass per client over the whole layout: per-column sums (float64, each
        column in row order, as the numpy path), counts and the bits."""
        k, d = x.shape
        off, rows, cols, groups = _plan(layout, self.params["scale"])
        total, nbytes = int(cols.sum()), (d + 7) // 8
        sums = torch.zeros(k, 2, total, dtype=torch.float64)
        cnt = torch.zeros(k, total, dtype=torch.int64)
        bits = torch.zeros(k, nbytes, dtype=torch.uint8)
        for i in range(k):
            so.fs_onebit_encode(native.ptr(x, i * d), len(off), native.ptr(off), native.ptr(rows), native.ptr(cols),
                                native.ptr(sums[i, 0]), native.ptr(sums[i, 1]), native.ptr(cnt, i * total),
                                native.ptr(bits, i * nbytes))
        sp, sn, cnt = sums[:, 0], sums[:, 1], cnt.to(torch.int32)
        n_all = torch.repeat_interleave(rows, cols).to(torch.int32)
        if any(g > 1 for g in groups):
            parts = [torch.split(t, cols.tolist(), dim=-1) for t in (sp, sn, cnt, n_all[None])]
            sp, sn, cnt, n_all = (torch.cat([_group_sum(p, g) for p, g in zip(ps, groups, strict=True)], 1)
                                  for ps in parts)
            n_all = n_all[0]
        return {"bits": bits, "means": _means(sp, sn, cnt, n_all)}

    def _array_specs(self, k, layout, params):
        return {
            "bits": (torch.uint8, (k, (layout.d + 7) // 8)),
            "means": (torch.float32, (k, _columns(layout, params["scale"]), 2)),
        }

    def _decode(self, arrays, k, layout, params, seed, out):
        means = arrays["means"]
        lo, hi = means[..., 0].contiguous(), means[..., 1].contiguous()  # (strided operands slow lerp ~10x)
        if bool((lo > 0).any()) or bool((hi < 0).any()):
            raise self._fail("'means' must hold (mean of negatives <= 0, mean of non-negatives >= 0)")
        dev = means.device
        so = native.lib() if dev.type == "cpu" else None
        if so is not None:  # one C select per tensor and client, straight from the bits
            return self._decode_native(so, arrays["bits"].contiguous(), lo, hi, k, layout, params,
                                       out_buffer(out, k, layout.d, dev))
        # 0/1 per value, then lerp in place: exact at both ends (it evaluates from the
        # nearer end), so a1 and a0 come back bit for bit (torch.where is ~10x slower here)
        out = lut_decode(arrays["bits"].to(dev), layout.d, bit_lut(0.0, 1.0, dev), out)
        c = 0
        for spec in layout.specs:
            rows, cols, g = _scale_shape(spec, params["scale"])
            n = -(-cols // g)
            sl = slice(spec.offset, spec.end)
            a0, a1 = lo[:, c : c + n], hi[:, c : c + n]
            if g > 1:  # each group's pair to each of its columns
                a0, a1 = a0.repeat_interleave(g, dim=1)[:, :cols], a1.repeat_interleave(g, dim=1)[:, :cols]
            w = out[:, sl].view(k, rows, cols)
            torch.lerp(a0[:, None, :].expand(k, rows, cols), a1[:, None, :].expand(k, rows, cols), w, out=w)
            c += n
        return out

    @staticmethod
    def _decode_native(so, bits, lo, hi, k, layout, params, out):
        off, rows, cols, groups = _plan(layout, params["scale"])
        if any(g > 1 for g in groups):  # each group's pair to each of its columns
            n = [-(-c // g) for c, g in zip(cols.tolist(), groups, strict=True)]
            lo, hi = (torch.cat([p.repeat_interleave(g, dim=1)[:, :c] for p, g, c in
                                 zip(torch.split(t, n, dim=1), groups, cols.tolist(), strict=True)], 1)
                      for t in (lo, hi))
        lo, hi = lo.contiguous(), hi.contiguous()
        d, nbytes, total = layout.d, bits.shape[1], lo.shape[1]
        for i in range(k):
            so.fs_onebit_decode(native.ptr(bits, i * nbytes), len(off), native.ptr(off), native.ptr(rows),
                                native.ptr(cols), native.ptr(lo, i * total), native.ptr(hi, i * total),
                                native.ptr(out, i * d))
        return out

    def wire_bytes(self, layout, K=1):
        return K * ((layout.d + 7) // 8 + 8 * _columns(layout, self.params["scale"]))


class SignCodec(Codec):
    """Scaled sign (EF-signSGD): each value becomes ±scale, one scale per client.

    ``Q(x) = (||x||_1 / d) · sign(x)``, with sign(0) = +1. The scale is the l1 mean of the
    whole vector of one client (not per tensor). Biased; with error feedback it converges
    like SGD.

    Wire: K·(ceil(d/8) + 4) bytes: ``bits`` uint8 [K, ceil(d/8)] packed as in ``onebit``
    (bit set = non-negative) and ``scale`` float32 [K].

    Paper: Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019.
    """

    name = "sign"
    paper = "Karimireddy et al., ICML 2019"

    def _encode(self, x, layout, seed):
        so = native.lib() if x.device.type == "cpu" else None
        if so is not None:  # one fused pass per client: bits and sum |x| (in float64)
            x = x.contiguous()
            k, d = x.shape
            nbytes = (d + 7) // 8
            bits = torch.zeros(k, nbytes, dtype=torch.uint8)
            l1 = [so.fs_sign_encode(native.ptr(x, i * d), d, native.ptr(bits, i * nbytes)) for i in range(k)]
            return {"bits": bits, "scale": (torch.tensor(l1, dtype=torch.float64) / d).to(torch.float32)}
        scale = torch.linalg.vector_norm(x, 1, dim=1) / layout.d
        return {"bits": sign_bits(x), "scale": scale}

    def _array_specs(self, k, layout, params):
        return {"bits": (torch.uint8, (k, (layout.d + 7) // 8)), "scale": (torch.float32, (k,))}

    def _decode(self, arrays, k, layout, params, seed, out):
        scale = arrays["scale"]
        if bool((scale < 0).any()):
            raise self._fail("'scale' must be >= 0")
        return lut_decode(arrays["bits"], layout.d, bit_lut(-scale, scale, scale.device), out)

    def wire_bytes(self, layout, K=1):
        return K * ((layout.d + 7) // 8 + 4)


def _bucket_mul(src: torch.Tensor, factor: torch.Tensor, bucket: int, out: torch.Tensor) -> torch.Tensor:
    """``out[k, i] = src[k, i] * factor[k, i // bucket]`` without expanding ``factor``."""
    k, d = src.shape
    nf = d // bucket
    m = nf * bucket
    if nf:
        torch.mul(src[:, :m].view(k, nf, bucket), factor[:, :nf, None], out=out[:, :m].view(k, nf, bucket))
    if m < d:
        torch.mul(src[:, m:], factor[:, nf:], out=out[:, m:])
    return out


class QSGDCodec(Codec):
    """QSGD: stochastic rounding to ``levels`` uniform levels of the bucket's l2 norm.

    For each bucket of ``bucket`` consecutive values (the whole vector if 0), with
    s = ``levels`` and y_i = s·x_i/||x_bucket||_2 in [-s, s]::

        code_i = floor(y_i + u_i),  u_i ~ U[0, 1)    (= sign(x_i)·(floor|y_i| or ceil|y_i|))
        Q(x)_i = ||x_bucket||_2 / s · code_i

    Unbiased (E[code_i] = y_i), with variance per bucket <= min(n/s^2, sqrt(n)/s)·||x||^2,
    so no error feedback is needed. Inputs with s·x_i/||x|| integral (e.g. [3, 4, 12] with
    s = 13) are reproduced exactly. Row i of a batch draws its noise from ``seed + i``
    (one torch.Generator per row; CPU and CUDA generators differ, decoding does not care).

    Wire: K·(b·d + 4·ceil(d/bucket)) bytes, b = 1 (int8 codes) for s <= 127 else 2 (int16):
    ``codes`` [K, d] and ``norms`` float32 [K, ceil(d/bucket)]. The paper's Elias coding
    of the codes, which would be smaller, is not implemented.

    Paper: Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding", NeurIPS 2017 (buckets of 512 in its experiments).
    """

    name = "qsgd"
    paper = "Alistarh et al., NeurIPS 2017"
    unbiased = True
    error_feedback = False
    hyperparams = (
        HyperParam("levels", 16, "quantization levels s (codes in [-s, s]; int16 codes above 127)", ge=1, le=32767),
        HyperParam("bucket", 512, "values sharing one norm (0: one norm per client)", ge=0),
    )

    @staticmethod
    def _shape(d: int, params: dict[str, Any]) -> tuple[int, int, torch.dtype]:
        bucket = params["bucket"] or d
        bucket = min(bucket, d)
        dtype = torch.int8 if params["levels"] <= 127 else torch.int16
        return bucket, -(-d // bucket), dtype

    def _encode(self, x, layout, seed):
        k, d = x.shape
        s = self.params["levels"]
        bucket, nb, dtype = self._shape(d, self.params)
        nf, m = d // bucket, (d // bucket) * bucket
        norms = torch.empty(k, nb, dtype=torch.float32, device=x.device)
        if nf:
            norms[:, :nf] = torch.linalg.vector_norm(x[:, :m].view(k, nf, bucket), dim=2)
        if m < d:
            norms[:, nf] = torch.linalg.vector_norm(x[:, m:], dim=1)
        factor = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        y = _bucket_mul(x, factor, bucket, torch.empty_like(x))
        noise = torch.empty_like(x)
        for i in range(k):  # the one per-client loop: torch has no per-row random streams
            g = torch.Generator(device=x.device)
            g.manual_seed(seed + i)
            torch.rand(d, generator=g, device=x.device, out=noise[i])
        codes = y.add_(noise).floor_().clamp_(-s, s).to(dtype)
        return {"codes": codes, "norms": norms}

    def _array_specs(self, k, layout, params):
        _, nb, dtype = self._shape(layout.d, params)
        return {"codes": (dtype, (k, layout.d)), "norms": (torch.float32, (k, nb))}

    def _decode(self, arrays, k, layout, params, seed, out):
        codes, norms = arrays["codes"], arrays["norms"]
        s = params["levels"]
        bucket, _, _ = self._shape(layout.d, params)
        if bool((norms < 0).any()):
            raise self._fail("'norms' must be >= 0")
        lo, hi = torch.aminmax(codes) if codes.numel() else (0, 0)
        if int(lo) < -s or int(hi) > s:  # (not abs(): abs(-128) overflows int8)
            raise self._fail(f"'codes' must lie in [-{s}, {s}] for levels={s}")
        return _bucket_mul(codes, norms / s, bucket, out_buffer(out, k, layout.d, codes.device))

    def wire_bytes(self, layout, K=1):
        d = layout.d
        _, nb, dtype = self._shape(d, self.params)
        return K * ((1 if dtype == torch.int8 else 2) * d + 4 * nb)
