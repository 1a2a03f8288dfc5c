"""Fused CPU loops for the codecs' memory-bound passes, in C, built on first use.

A codec pass like "sum |x| and pack x >= 0 into bits" is one read of x when written as
one loop, but three or four when composed from numpy/torch ops (each op streams its
operands through memory, or at best through cache with a call's overhead per chunk).
These few loops are written in C in ``csrc/`` beside this module (``codecs.c``,
``countsketch.c``; their API, the ``fs_*`` functions, in ``fs_kernels.h``), compiled once
with the system's C compiler (``cc -O3 -march=native`` with warnings as errors, a few
seconds) into a shared library kept under ``$XDG_CACHE_HOME/fedswarm/native`` (``~/.cache``
by default; the file name hashes the sources, the flags, the compiler and the CPU), and
called through ctypes on contiguous CPU tensors, with signatures read from the header.

Everything here is optional: :func:`lib` returns None when there is no compiler,
``FEDSWARM_NATIVE=0`` is set, or :func:`disabled` is active, and the codecs then run their
eager numpy/torch code, which stays the oracle the tests hold these loops to (bit for bit,
or to float tolerance where a summation order differs). A build that fails, or a library
this CPU cannot run, also returns None, but says so once in a :class:`NativeBuildWarning`
naming the compiler's first error (:func:`build_error` has the whole of it).
``FEDSWARM_NATIVE_MARCH`` picks the ``-march`` (default ``native``): CI builds
``x86-64-v3`` (the AVX2 branch) and ``x86-64`` (the scalar one) too; :func:`isa` says which
branch a library holds.

The loops take raw pointers: the Python wrappers in the codecs check shapes, dtypes and
contiguity before calling them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["lib", "disabled", "ptr", "isa", "march", "compiler", "build", "build_error", "prototypes", "CSRC",
           "sources", "HEADER", "NativeBuildError", "NativeBuildWarning"]

CSRC = Path(__file__).with_name("csrc")  # the C sources, shipped as package data
HEADER = "fs_kernels.h"


def sources() -> Path:
    """Where the C sources are: :data:`CSRC` beside this module, or, when this module runs from a
    copy without them, those of the installed fedswarm distribution (its package data, or an
    editable install's tree, PEP 610's ``direct_url.json``). A Flower App bundle is such a copy:
    a SuperNode runs fedswarm's ClientApp from the FAB, which carries only ``.py``, ``.toml``,
    ``.md`` and a few other kinds of file, never ``.c``. FileNotFoundError if neither has them."""
    if (CSRC / HEADER).is_file():
        return CSRC
    from fedswarm.installed import installed_file

    header = installed_file(f"compression/csrc/{HEADER}", f"algorithms/compression/csrc/{HEADER}")
    if header is not None:
        return header.parent
    raise FileNotFoundError(f"the C sources ({HEADER}, *.c) are neither beside {Path(__file__).name} ({CSRC}) "
                            "nor in the installed fedswarm")


# -fno-trapping-math lets the compiler vectorize the selects (FP exception flags are never read);
# results are those of plain IEEE arithmetic in the order written (no -ffast-math; -std=c99 keeps
# a * b + c unfused). Warnings are errors: our own code, and a warning in intrinsics code is
# usually a bug. -fvisibility=hidden: only the header's FS_API functions are exported.
_FLAGS = ["-O3", "-fno-trapping-math", "-std=c99", "-Wall", "-Wextra", "-Wmissing-prototypes", "-Werror",
          "-fvisibility=hidden", "-shared", "-fPIC"]
_lock = threading.Lock()
_state: dict[str, object] = {}
_off = threading.local()


class NativeBuildError(RuntimeError):
    """The C loops did not compile or load (the message holds the compiler's output)."""


class NativeBuildWarning(RuntimeWarning):
    """The C loops are not in use although a compiler is there: the codecs run their torch code."""


def march() -> str:
    """The ``-march`` to build for: ``FEDSWARM_NATIVE_MARCH``, default ``native``."""
    m = os.environ.get("FEDSWARM_NATIVE_MARCH", "") or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", m):
        raise ValueError(f"FEDSWARM_NATIVE_MARCH={m!r}: expected a -march name such as native, x86-64-v3 or x86-64")
    return m


def compiler() -> str | None:
    """The C compiler to build with (``$CC``, else ``cc`` or ``gcc`` on the PATH), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


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


_CTYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "double": ctypes.c_double}


def _ctype(decl: str, where: str):
    """The ctypes type of a C type (a return type, or a parameter without its name)."""
    if "*" in decl:
        return ctypes.c_char_p if re.fullmatch(r"const char\s*\*", decl.strip()) else ctypes.c_void_p
    base = " ".join(w for w in decl.split() if w != "const")
    if base not in _CTYPES:
        raise ValueError(f"{HEADER}: {where}: no ctypes type for {decl.strip()!r} (use int, int64_t, float, "
                         "double or a pointer)")
    return _CTYPES[base]


def prototypes(header: str) -> dict[str, tuple[object, list]]:
    """``{name: (restype, argtypes)}`` of the header's ``FS_API`` declarations: the one place
    the library's C signatures meet ctypes (the compiler holds the definitions to the header)."""
    out: dict[str, tuple[object, list]] = {}
    for ret, name, params in re.findall(r"FS_API\s+([^;(]*?)\s*\b(fs_\w+)\s*\(([^)]*)\)\s*;", header):
        args = [] if params.strip() in ("", "void") else [
            _ctype(re.sub(r"\w+\s*$", "", p.strip()), f"{name}({p.strip()})") for p in params.split(",")]
        out[name] = (_ctype(ret, name), args)
    if not out:
        raise ValueError(f"{HEADER}: no FS_API declarations")
    return out


def _first_error(log: str) -> str:
    lines = log.splitlines()
    return next((ln for ln in lines if re.search(r"\berror:", ln)),
                next((ln for ln in lines if ln.strip()), "no output"))


def build(csrc: Path | None = None, arch: str | None = None) -> ctypes.CDLL:
    """Compile the C files of ``csrc`` (default :func:`sources`) for ``-march=arch`` (default
    :func:`march`), once per sources, flags, compiler and CPU (the cached library is reused),
    load it and set its signatures from the header. Raises :class:`NativeBuildError` (with
    the compiler's output) if it does not build, load, or run on this CPU; FileNotFoundError
    without a compiler."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (set CC, or install cc)")
    csrc, arch = csrc or sources(), arch or march()
    flags = [f"-march={arch}", *_FLAGS]
    files = sorted(p for p in csrc.iterdir() if p.suffix in (".c", ".h"))
    exe = shutil.which(cc) or cc
    try:  # a compiler upgraded in place builds anew
        st = os.stat(exe)
        cc_id = f"{os.path.realpath(exe)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        cc_id = cc
    key = hashlib.sha256()
    for part in [*(p.name + "\0" + p.read_text() for p in files), *flags, cc_id, platform.machine(), _cpu_key()]:
        key.update(part.encode() + b"\0")
    path = _cache_dir() / f"codec_kernels_{key.hexdigest()[:20]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            so = Path(tmp) / "k.so"
            cmd = [cc, *flags, *(str(p) for p in files if p.suffix == ".c"), "-o", str(so), "-lm"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise NativeBuildError(f"{' '.join(cmd)}: {e}") from e
            if done.returncode != 0:
                raise NativeBuildError(f"{' '.join(cmd)} failed:\n{done.stderr or done.stdout}")
            os.replace(so, path)  # atomic: a concurrent builder finds a whole file or none
    try:
        so = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeBuildError(f"loading {path}: {e}") from e
    protos = prototypes((csrc / HEADER).read_text())
    for i, name in enumerate(dict.fromkeys(["fs_isa", "fs_cpu_ok", *protos])):  # the CPU checked before any loop
        if not hasattr(so, name):  # declared but never defined: a shared library still links
            raise NativeBuildError(f"error: {HEADER} declares {name}, which the library does not define")
        getattr(so, name).restype, getattr(so, name).argtypes = protos[name]
        if i == 1 and not so.fs_cpu_ok():
            raise NativeBuildError(f"error: built for -march={arch} ({so.fs_isa().decode()}), "
                                   "which this CPU does not run")
    return so


def _load() -> ctypes.CDLL | None:
    if compiler() is None:
        return None
    arch = march()  # a bad FEDSWARM_NATIVE_MARCH is the caller's error, raised
    try:
        return build(arch=arch)
    except (NativeBuildError, ValueError, FileNotFoundError) as e:  # ValueError: a header type ctypes
        _state["error"] = str(e)  # is not given; FileNotFoundError: no sources here (the compiler is)
        warnings.warn(f"fedswarm's C codec loops are off, the codecs run their torch code: {_first_error(str(e))}",
                      NativeBuildWarning, stacklevel=3)
        return None


def lib() -> ctypes.CDLL | None:
    """The compiled loops, or None (no compiler, ``FEDSWARM_NATIVE=0``, inside
    :func:`disabled`, or a failed build, which warns once): callers then take their eager path."""
    if getattr(_off, "depth", 0) or os.environ.get("FEDSWARM_NATIVE", "1") == "0":
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def build_error() -> str | None:
    """Why :func:`lib` is None although a compiler is there (the compiler's whole output), else None."""
    return _state.get("error")  # type: ignore[return-value]


def isa() -> str | None:
    """The branch the loops were compiled for: ``avx512``, ``avx2``, ``scalar``; None without them."""
    so = lib()
    return None if so is None else so.fs_isa().decode()


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
