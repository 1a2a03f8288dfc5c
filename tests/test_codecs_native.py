"""The C loops of the codecs (fedswarm.algorithms.compression.native) against the eager
numpy/torch code they replace (run under native.disabled(), the oracle), and decoding
into a caller's out= buffer; their build: the instruction-set branch compiled for
FEDSWARM_NATIVE_MARCH, a broken kernel failing loudly, the ctypes signatures read from the
header. Where a C compiler exists, a library that does not build fails this module instead
of skipping it (.ci/run runs it at -march native, x86-64-v3 and x86-64)."""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import warnings

import numpy as np
import pytest
import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression import native
from fedswarm.algorithms.compression.codecs import CODECS, make_codec
from fedswarm.algorithms.compression.kernels import _at_least_cpu, bit_lut, lut_decode, sign_bits, topk_abs_indices

from tests.codec_oracles import np_topk, randn



@pytest.fixture(autouse=True, scope="module")
def _built():
    """Skip without a compiler or with FEDSWARM_NATIVE=0; fail when a compiler is there and the
    library is not (the compiler's output in the message)."""
    if os.environ.get("FEDSWARM_NATIVE", "1") == "0":
        pytest.skip("FEDSWARM_NATIVE=0: the codecs run their eager code")
    if native.compiler() is None:
        pytest.skip("no C compiler: the codecs run their eager code")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", native.NativeBuildWarning)
        if native.lib() is None:
            pytest.fail(f"the C loops did not build:\n{native.build_error()}", pytrace=False)

# offsets not multiples of 8, columns of 1, 3, 13, 24, 27, 40, a scalar, d % 8 = 2
LAYOUT = ParamLayout.from_shapes([("a", (37, 24)), ("b", (5,)), ("c", (300, 13)), ("s", ()), ("conv", (64, 3, 3, 3)),
                                  ("e", (1000, 40)), ("f", (7, 3))])
D = LAYOUT.d


def _x(k: int = 3, d: int = D, seed: int = 0) -> torch.Tensor:
    x = randn(k, d, seed)
    x[0, 5:20] = 0.0  # sign(0) = +1
    x[1, 30:40] = -0.0  # -0.0 >= 0 too
    x[2, 900:1200] = np.abs(x[2, 900:1200])  # a stretch without negatives
    return torch.from_numpy(x)


def _both(fn):
    """``fn()`` with the C loops and with the eager code."""
    fast = fn()
    with native.disabled():
        assert native.lib() is None
        slow = fn()
    return fast, slow


@pytest.mark.parametrize("scale", ["column", "tensor", "auto", "block"])
def test_onebit_native_equals_eager(scale):
    codec, x = make_codec("onebit", scale=scale), _x()
    fast, slow = _both(lambda: codec.encode(x, LAYOUT))
    assert torch.equal(fast.arrays["bits"], slow.arrays["bits"])
    assert torch.equal(fast.arrays["bits"], sign_bits(x))
    torch.testing.assert_close(fast.arrays["means"], slow.arrays["means"], rtol=1e-6, atol=0)
    # decoding one payload both ways: a select of the stored floats, bit for bit
    dec_fast, dec_slow = _both(lambda: codec.decode(slow, LAYOUT))
    assert torch.equal(dec_fast, dec_slow)


def test_onebit_native_large_output_streamed_equals_eager():
    """Outputs over 8 MB are decoded with streaming stores (and fs_onebit_decode's fence):
    still the stored floats bit for bit, in aligned and unaligned tensors, columns and vectors."""
    layout = ParamLayout.from_shapes([("w", (4000, 512)), ("b", (3,)), ("v", (150_001,)), ("u", (700, 77))])
    assert 4 * layout.d > 8 << 20
    codec, x = make_codec("onebit", scale="auto"), torch.from_numpy(randn(1, layout.d, 7))
    fast, slow = _both(lambda: codec.encode(x, layout))
    assert torch.equal(fast.arrays["bits"], slow.arrays["bits"])
    torch.testing.assert_close(fast.arrays["means"], slow.arrays["means"], rtol=1e-6, atol=0)
    out = torch.full((1, layout.d), float("nan"))
    dec_fast, dec_slow = _both(lambda: codec.decode(slow, layout, out=out).clone())
    assert torch.equal(dec_fast, dec_slow)


@pytest.mark.parametrize("name", ["topk", "randk"])
def test_sparse_decode_of_a_large_output_streams_its_zeros_and_equals_eager(name):
    """Sparse decodes into an output over 8 MB stream the zeros (fs_scatter_dense, then a
    fence and the values): the same vector as torch's zero_ + scatter, over a NaN-filled
    buffer, for every client."""
    layout = ParamLayout.from_shapes([("w", (3000, 1000)), ("b", (7,))])
    assert 4 * layout.d > 8 << 20
    codec, x = make_codec(name, ratio=0.001), torch.from_numpy(randn(2, layout.d, 11))
    payload = codec.encode(x, layout, seed=4)
    out = torch.full((2, layout.d), float("nan"))
    dec_fast, dec_slow = _both(lambda: codec.decode(payload, layout, out=out).clone())
    assert torch.equal(dec_fast, dec_slow) and int((dec_fast != 0).sum()) == 2 * math.ceil(0.001 * layout.d)


def test_sign_native_equals_eager():
    codec, x = make_codec("sign"), _x()
    fast, slow = _both(lambda: codec.encode(x, LAYOUT))
    assert torch.equal(fast.arrays["bits"], slow.arrays["bits"])
    l1 = x.double().abs().sum(1) / D
    # the C loop sums in float64 (then rounds once), torch's float32 norm drifts ~1e-6 at d = 46k
    torch.testing.assert_close(fast.arrays["scale"].double(), l1, rtol=1e-7, atol=0)
    torch.testing.assert_close(slow.arrays["scale"].double(), l1, rtol=1e-5, atol=0)
    dec_fast, dec_slow = _both(lambda: codec.decode(slow, LAYOUT))
    assert torch.equal(dec_fast, dec_slow)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_lut_decode_native_equals_numpy(n):
    bits = torch.rand(3, n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = sign_bits(bits.float() - 0.5)
    lut = bit_lut(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([1.0, 3.0, 0.25]), "cpu")
    fast, slow = _both(lambda: lut_decode(packed, n, lut))
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("absolute", [True, False])
@pytest.mark.parametrize("m", [1, 2, 17, 3000])
def test_kth_largest_native_equals_kthvalue(m, absolute):
    """fs_kth_largest against torch's kthvalue, for every k: values with many ties, both
    zeros, both infinities, negatives, subnormals and values that share their top bits."""
    g = torch.Generator().manual_seed(m)
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, float("inf"), float("-inf"), 1e-40, -1e-40, 3.0000002, 3.0])
    vals = torch.where(torch.rand(m, generator=g) < 0.5, pool[torch.randint(0, pool.numel(), (m,), generator=g)],
                       torch.randn(m, generator=g) * 10 ** torch.randint(-3, 4, (m,), generator=g).float())
    ref = vals.abs() if absolute else vals
    so = native.lib()
    for k in range(1, m + 1) if m < 100 else (1, 2, 50, m // 2, m - 1, m):
        got = so.fs_kth_largest(native.ptr(vals), m, k, int(absolute))
        want = float(ref.kthvalue(m - k + 1).values)
        assert got == want, (m, k, absolute, got, want)


@pytest.mark.parametrize("k", [1, 200, 5000])
def test_topk_native_equals_eager_on_the_sampled_path(k):
    x = _x(3, 200_003, seed=k)
    fast, slow = _both(lambda: topk_abs_indices(x, k))
    assert torch.equal(fast, slow)
    layout = ParamLayout.from_shapes([("w", (200_003,))])
    codec = make_codec("topk", ratio=k / 200_003)
    dec = codec.decode(codec.encode(x, layout), layout).numpy()
    np.testing.assert_array_equal(dec, np_topk(x.numpy(), k / 200_003))


def test_topk_native_ties_keep_the_first_positions():
    x = torch.zeros(1, 100_000)
    x[0, ::7] = 1.0  # 14286 values tie for the top
    idx = topk_abs_indices(x, 1000)
    assert torch.equal(idx[0], torch.arange(0, 7000, 7))


def test_candidate_scan_native_equals_numpy():
    x = _x(3, 200_003, seed=5)
    thr = torch.tensor([[1.0], [2.5], [0.0]])
    fast, slow = _both(lambda: _at_least_cpu(x, thr))
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decode_into_out_equals_a_fresh_decode(name):
    params = {"topk": {"ratio": 0.05}, "randk": {"ratio": 0.1}, "countsketch": {"k_ratio": 0.05}}.get(name, {})
    codec, x = make_codec(name, **params), _x()
    payload = codec.encode(x, LAYOUT, seed=3)
    out = torch.full((3, D), float("nan"))  # every element must be written (sparse codecs: zeroed)
    got = codec.decode(payload, LAYOUT, out=out)
    assert got is out
    assert torch.equal(out, codec.decode(payload, LAYOUT))
    view = torch.full((5, D), float("nan"))[1:4]  # a contiguous view, as the batched engine passes
    codec.decode(payload, LAYOUT, out=view)
    assert torch.equal(view, out)


def test_decode_rejects_a_bad_out_buffer():
    codec = make_codec("sign")
    payload = codec.encode(_x(), LAYOUT)
    for bad in [torch.empty(2, D), torch.empty(3, D, dtype=torch.float64), torch.empty(D, 3).t()]:
        with pytest.raises(ValueError, match="out must be a contiguous float32"):
            codec.decode(payload, LAYOUT, out=bad)


@pytest.mark.parametrize("d, rows, cols", [(250_001, 5, 4096), (10_001, 3, 200), (8192, 4, 4096)])
def test_countsketch_native_sketch_equals_eager(d, rows, cols):
    from fedswarm.algorithms.compression.countsketch import CountSketch

    cs = CountSketch(d, rows, cols, seed=7)
    assert cs._loop  # the block loop the C kernel replaces
    x = _x(3, d, seed=d)
    fast, slow = _both(lambda: cs.sketch(x))
    # the C loop adds into rows of c cells, the torch loop into doubled rows it folds at the
    # end: the same terms, summed in another order, so equal to float32 rounding; both
    # against the float64 sketch (the eager path's, which works in x's dtype)
    with native.disabled():
        exact = cs.sketch(x.double())
    scale = float(exact.abs().max())
    for got in (fast, slow):
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-6 * scale)
    assert not torch.equal(fast, torch.zeros_like(fast))


@pytest.mark.parametrize("d, rows, cols", [(4810, 5, 50), (30_001, 3, 300)])
def test_countsketch_native_sketch_of_many_short_blocks(d, rows, cols):
    """Many short blocks: the C loop against the eager index_add_ path (other addition
    order, so to rounding), and a batch against one client at a time (exactly), on both
    paths; 600 clients make the eager path work in client chunks."""
    from fedswarm.algorithms.compression.countsketch import _CHUNK_CPU, CountSketch

    cs = CountSketch(d, rows, cols, seed=5)
    assert not cs._loop
    x = torch.from_numpy(randn(600, d, seed=d))
    assert 600 * (cs._span + rows * (2 * cols + 1)) > 2 * _CHUNK_CPU  # several chunks
    fast, slow = _both(lambda: cs.sketch(x))
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    some = [0, 1, 257, 599]
    one_fast, one_slow = _both(lambda: torch.stack([cs.sketch(x[i]) for i in some]))
    assert torch.equal(fast[some], one_fast) and torch.equal(slow[some], one_slow)


@pytest.mark.parametrize("loop", [True, False])
@pytest.mark.parametrize("d, k, rows, cols", [(200_000, 200, 5, 2000), (300_001, 50, 4, 500), (100_003, 300, 1, 3000),
                                              (250_001, 100, 7, 4096), (120_007, 40, 9, 1000)])
def test_countsketch_native_candidates_equal_eager(d, k, rows, cols, loop):
    """unsketch's candidate pass in C against the numpy (loop) and torch (many blocks)
    passes: the same coordinates and estimates, exactly."""
    from fedswarm.algorithms.compression.countsketch import CountSketch

    cs = CountSketch(d, rows, cols, seed=3)
    cs._loop = loop
    x = torch.from_numpy(randn(3, d, seed=d))
    x[:, ::997] *= 40
    table = cs.sketch(x)
    fast, slow = _both(lambda: cs._unsketch_sparse(table, k))
    assert fast is not None and slow is not None  # the candidate path, both times
    _same_top_k(fast, slow)


def test_countsketch_native_candidates_with_too_little_room_are_found_again():
    """A first try with room for fewer candidates than there are (the kernel writes what
    fits and says how many there are) gives, on the second try, exactly the candidates
    that ample room gives."""
    from fedswarm.algorithms.compression import countsketch_native
    from fedswarm.algorithms.compression.countsketch import CountSketch

    d = 250_001
    cs = CountSketch(d, 5, 1000, seed=4)
    table = cs.sketch(torch.from_numpy(randn(2, d, seed=4)))
    thr = table.abs().amax(dim=(1, 2)).unsqueeze(1) / 40
    roomy = countsketch_native.candidates(cs, native.lib(), table, thr, 100, cap=10 * d)
    assert min(idx.numel() for idx, _ in roomy) > 100
    for cap in (1, 17, 99):
        tight = countsketch_native.candidates(cs, native.lib(), table, thr, 100, cap=cap)
        for (ri, rv), (ti, tv) in zip(roomy, tight, strict=True):
            assert torch.equal(ri, ti) and torch.equal(rv, tv)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_countsketch_native_threshold_equals_eager(rows):
    """unsketch's threshold (the rank-th largest |estimate| at the fixed sample) in C
    against _estimate_at + topk, exactly, for every rank tried: a wrong threshold would
    only show in the final top-k when it made fewer than k candidates."""
    from fedswarm.algorithms.compression import countsketch_native
    from fedswarm.algorithms.compression.countsketch import CountSketch
    from fedswarm.algorithms.compression.kernels import sample_positions

    d = 300_001
    cs = CountSketch(d, rows, 700, seed=rows)
    x = torch.from_numpy(randn(2, d, seed=rows))
    x[0, ::13] = 0.0
    table = cs.sketch(x)
    sample = sample_positions(d)
    h, s = cs.hashes(sample)
    cell = (h + cs.cols * torch.arange(rows).unsqueeze(1)).contiguous()
    est = cs._estimate_at(table, h, s).abs()
    for rank in (1, 7, 45, 1000, sample.numel()):
        fast = countsketch_native.threshold(cs, native.lib(), table, cell, s.contiguous(), rank)
        assert torch.equal(fast, est.topk(rank, dim=1).values[:, -1:]), rank


def _same_top_k(fast, slow):
    """Two unsketch results agree: per client k ascending coordinates, the same estimates
    where they pick the same coordinate, and any coordinate only one of them picks is a tie
    at the k-th magnitude (unsketch breaks those ties arbitrarily: the C path takes the
    first candidates, torch's topk any)."""
    for (fi, fv), (si, sv) in zip(zip(*fast, strict=True), zip(*slow, strict=True), strict=True):
        assert bool((fi[1:] > fi[:-1]).all()) and bool((si[1:] > si[:-1]).all())
        kth = float(sv.abs().min())
        assert float(fv.abs().min()) == kth
        both, f_at, s_at = np.intersect1d(fi.numpy(), si.numpy(), return_indices=True)
        assert torch.equal(fv[f_at], sv[s_at])
        for idx, val, at in ((fi, fv, f_at), (si, sv, s_at)):
            alone = np.setdiff1d(np.arange(idx.numel()), at)
            assert bool((val[alone].abs() == kth).all())


def test_topk_of_float64_rows_skips_the_float32_loops():
    x = _x(3, 100_000, seed=9).double()
    assert torch.equal(topk_abs_indices(x, 300), topk_abs_indices(x.float(), 300))


def test_sketch_profile_times_the_codecs_own_kernel(tmp_path):
    """``fedswarm.bench.codecs --sketch-profile``: the four steps, timed beside a warm copy,
    and the kernel it times reproduces the codec's table (checked inside the profile)."""
    from fedswarm.bench.codecs import sketch_profile

    rows = sketch_profile(tmp_path, d=60_000, repeats=2)
    assert [r["step"].split(" ")[0] for r in rows] == ["encode", "encode", "encode", "decode"]
    assert all(r["ms"] > 0 and r["copy_ms"] > 0 and r["vs_copy_"] > 0 and r["runs"] >= 1 for r in rows)
    assert rows[0]["cols"] == 10 * rows[0]["k"] and (tmp_path / "countsketch_profile.json").exists()


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith(("flags", "Features"))), set())


def test_the_library_holds_the_branch_of_the_requested_march():
    """The ISA the library reports (its preprocessor branch) is the one FEDSWARM_NATIVE_MARCH asks
    for; for native, the one this CPU's flags in /proc/cpuinfo allow."""
    levels = {"x86-64": "scalar", "x86-64-v2": "scalar", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}
    if native.march() == "native":
        flags = _cpu_flags()
        want = "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "scalar"
    elif native.march() in levels:
        want = levels[native.march()]
    else:
        pytest.skip(f"no expected branch known for -march={native.march()}")
    assert native.isa() == want


def test_signatures_come_from_the_header():
    """Every FS_API function of fs_kernels.h is bound with the header's types (written out here
    for two), and a type ctypes is not given refuses to bind."""
    protos = native.prototypes((native.CSRC / native.HEADER).read_text())
    assert len(protos) == 15
    assert protos["fs_sign_encode"] == (ctypes.c_double, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])
    assert protos["fs_kth_largest"] == (ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                         ctypes.c_int])
    assert protos["fs_isa"] == (ctypes.c_char_p, [])
    so = native.lib()
    for name, (restype, argtypes) in protos.items():
        assert getattr(so, name).restype == restype and getattr(so, name).argtypes == argtypes, name
    with pytest.raises(ValueError, match=r"fs_x\(size_t n\).*'size_t'"):
        native.prototypes("FS_API int fs_x(size_t n);")


@pytest.mark.parametrize("broken, message", [
    (("double fs_sign_encode(const float *x,", "double fs_sign_encode(const float *x x,"), r"codecs\.c:\d+:\d+: error"),
    (("double fs_sign_encode(const float *x, int64_t n,", "double fs_sign_encode(const float *x, int n,"),
     r"codecs\.c:\d+:\d+: error: conflicting types for .fs_sign_encode"),
    (("    double lane[8] =", "    int unused;\n    double lane[8] ="), r"codecs\.c:\d+:\d+: error: unused variable"),
])
def test_a_broken_kernel_fails_loudly(tmp_path, monkeypatch, broken, message):
    """A syntax error, a definition that differs from its header prototype, or a warning: the
    build fails, and lib() warns with the compiler's first error line and returns None (the
    sources: the header and the broken file, which is all the compiler needs to fail)."""
    src = tmp_path / "csrc"
    src.mkdir()
    shutil.copy(native.CSRC / native.HEADER, src)
    code = (native.CSRC / "codecs.c").read_text()
    assert broken[0] in code
    (src / "codecs.c").write_text(code.replace(broken[0], broken[1], 1))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "CSRC", src)
    monkeypatch.setattr(native, "_state", {})
    with pytest.warns(native.NativeBuildWarning, match=message):
        assert native.lib() is None
    assert re.search(message, native.build_error())  # the compiler's whole output
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing cached from a failed build


def test_a_function_declared_but_not_defined_is_refused(tmp_path, monkeypatch):
    """A shared library links with a header function left undefined: the loader finds it
    missing and says which (here every loop: only isa.c is built)."""
    src = tmp_path / "csrc"
    src.mkdir()
    for name in (native.HEADER, "isa.c"):
        shutil.copy(native.CSRC / name, src)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(native.NativeBuildError, match="declares fs_sign_encode, which the library does not define"):
        native.build(src)


def test_a_library_this_cpu_cannot_run_is_refused(tmp_path, monkeypatch):
    """fs_cpu_ok false (as for a -march wider than the CPU's): refused before any loop runs,
    naming the -march and the branch."""
    src = tmp_path / "csrc"
    src.mkdir()
    shutil.copy(native.CSRC / native.HEADER, src)
    code = (native.CSRC / "isa.c").read_text()
    assert "int fs_cpu_ok(void) {" in code
    (src / "isa.c").write_text(code.replace("int fs_cpu_ok(void) {", "int fs_cpu_ok(void) {\n    return 0;", 1))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(native.NativeBuildError, match=r"built for -march=x86-64 \(scalar\), which this CPU does not"):
        native.build(src, arch="x86-64")


def test_native_off_and_a_bad_march(monkeypatch):
    """FEDSWARM_NATIVE=0 turns the loops off; a -march that is not a name is refused by name."""
    monkeypatch.setenv("FEDSWARM_NATIVE", "0")
    assert native.lib() is None
    monkeypatch.setenv("FEDSWARM_NATIVE", "1")
    monkeypatch.setenv("FEDSWARM_NATIVE_MARCH", "x86-64; rm -rf /")
    with pytest.raises(ValueError, match="FEDSWARM_NATIVE_MARCH"):
        native.march()


def test_sources_of_the_installed_fedswarm_serve_a_copy_without_them(tmp_path, monkeypatch):
    """A SuperNode runs fedswarm's ClientApp from its Flower App bundle, which carries only .py
    (and a few other) files, never the C sources: native then builds from the installed
    fedswarm's copy of them (package data, or an editable install's tree)."""
    here = native.CSRC
    monkeypatch.setattr(native, "CSRC", tmp_path / "fab" / "csrc")  # a FAB's copy of native.py: no csrc beside it
    found = native.sources()
    assert found != native.CSRC and (found / native.HEADER).read_text() == (here / native.HEADER).read_text()
    assert native.build(arch="x86-64" if os.uname().machine == "x86_64" else None).fs_isa()


def test_no_sources_anywhere_warns_and_runs_the_torch_code(tmp_path, monkeypatch):
    import fedswarm.installed

    monkeypatch.setattr(native, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(fedswarm.installed.metadata, "distributions", lambda **_kw: iter(()))  # none installed
    with pytest.raises(FileNotFoundError, match="C sources"):
        native.sources()
    with pytest.warns(native.NativeBuildWarning, match="C sources"):
        assert native._load() is None
