"""Fused CPU loops for the codecs' memory-bound passes, in C, built on first use.

A codec pass like "sum |x| and pack x >= 0 into bits" is one read of x when written as
one loop, but three or four when composed from numpy/torch ops (each op streams its
operands through memory, or at best through cache with a call's overhead per chunk).
These few loops are written in C here, compiled once with the system's C compiler
(``cc -O3 -march=native``, about a second) into a shared library kept under
``$XDG_CACHE_HOME/fedswarm/native`` (``~/.cache`` by default; the file name hashes the
source, the flags and the CPU), and called through ctypes on contiguous CPU tensors.

Everything here is optional: :func:`lib` returns None when there is no compiler, the
build fails, ``FEDSWARM_NATIVE=0`` is set, or :func:`disabled` is active, and the codecs
then run their eager numpy/torch code, which stays the oracle the tests hold these loops
to (bit for bit, or to float tolerance where a summation order differs).

The loops (the ``fs_*`` functions in ``native_source.py`` and
``native_sketch_source.py``) take raw pointers: the Python wrappers in the codecs check
shapes, dtypes and contiguity before calling them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from fedswarm.algorithms.compression.native_sketch_source import SKETCH_SOURCE
from fedswarm.algorithms.compression.native_source import SOURCE

__all__ = ["lib", "disabled", "ptr"]

_SOURCE = SOURCE + SKETCH_SOURCE  # the C loops, one file; hashed into the library's file name


# -fno-trapping-math lets the compiler vectorize the selects (FP exception flags are never read);
# results are those of plain IEEE arithmetic in the order written (no -ffast-math)
_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-shared", "-fPIC", "-std=c99"]
_lock = threading.Lock()
_state: dict[str, object] = {}
_off = threading.local()


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fedswarm" / "native"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, cc, platform.machine(), _cpu_key()]).encode()).hexdigest()
    path = _cache_dir() / f"codec_kernels_{key[:20]}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, so = Path(tmp) / "k.c", Path(tmp) / "k.so"
                src.write_text(_SOURCE)
                subprocess.run([cc, *_FLAGS, str(src), "-o", str(so), "-lm"], check=True, capture_output=True,
                               timeout=120)
                os.replace(so, path)  # atomic: a concurrent builder finds a whole file or none
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        so = ctypes.CDLL(str(path))
    except OSError:
        return None
    i64, f32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    so.fs_sign_encode.argtypes, so.fs_sign_encode.restype = [vp, i64, vp], ctypes.c_double
    so.fs_lut_decode.argtypes, so.fs_lut_decode.restype = [vp, i64, vp, vp], None
    so.fs_onebit_encode.argtypes, so.fs_onebit_encode.restype = [vp, i64, vp, vp, vp, vp, vp, vp, vp], None
    so.fs_onebit_decode.argtypes, so.fs_onebit_decode.restype = [vp, i64, vp, vp, vp, vp, vp, vp], None
    so.fs_scatter_dense.argtypes, so.fs_scatter_dense.restype = [vp, i64, vp, vp, i64], None
    so.fs_collect_abs_ge.argtypes, so.fs_collect_abs_ge.restype = [vp, i64, f32, vp, vp, i64], i64
    so.fs_select_top.argtypes, so.fs_select_top.restype = [vp, vp, i64, i64, vp], i64
    so.fs_kth_largest.argtypes, so.fs_kth_largest.restype = [vp, i64, i64, ctypes.c_int], f32
    so.fs_sketch.argtypes, so.fs_sketch.restype = [vp, i64, i64, i64, i64, vp, vp, vp, vp, vp, vp, vp], None
    so.fs_cs_sample_threshold.argtypes = [vp, i64, i64, vp, vp, i64, vp]
    so.fs_cs_sample_threshold.restype = f32
    so.fs_cs_top.argtypes, so.fs_cs_top.restype = [vp, vp, i64, i64, vp, vp, vp, vp], i64
    so.fs_cs_candidates.argtypes = [vp, i64, i64, i64, i64, vp, vp, vp, f32, vp, i64, vp, vp]
    so.fs_cs_candidates.restype = i64
    so.fs_cs_scratch_words.argtypes, so.fs_cs_scratch_words.restype = [i64, i64], i64
    return so


def lib() -> ctypes.CDLL | None:
    """The compiled loops, or None (no compiler, a failed build, ``FEDSWARM_NATIVE=0``, or
    inside :func:`disabled`): callers then take their eager path."""
    if getattr(_off, "depth", 0) or os.environ.get("FEDSWARM_NATIVE", "1") == "0":
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _build()
    return _state["lib"]  # type: ignore[return-value]


@contextlib.contextmanager
def disabled():
    """Within this block (on this thread) :func:`lib` is None: the codecs run their eager
    code, the oracle of the tests."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def ptr(t: torch.Tensor, offset: int = 0) -> int:
    """The address of element ``offset`` of a contiguous CPU tensor (checked). The caller
    keeps ``t`` alive across the C call: ``ptr(torch.empty(n))`` frees its memory before
    the call runs."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("native kernels need contiguous CPU tensors")
    return t.data_ptr() + offset * t.element_size()
