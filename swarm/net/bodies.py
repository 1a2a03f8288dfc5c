"""Received message bodies: large buffers pooled and reused once nobody refers to them, and
float32 bodies scanned for non-finite values chunk by chunk as they arrive. The envelope
(:mod:`fedswarm.swarm.net.envelope`) takes every body it reads from here."""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

__all__ = ["BODY_POOL", "POOL_MIN_BYTES", "BodyPool", "FiniteScan", "alloc_body", "float_scan"]


#: Received bodies of at least this size come from :data:`BODY_POOL` (smaller ones are cheap to allocate).
POOL_MIN_BYTES = 4 << 20


class BodyPool:
    """The last few large body buffers, handed out again once nothing refers to them.

    A fresh 40 MB buffer costs its page faults and the kernel's zeroing (~3 ms of CPU, the
    ``profile`` rows of ``fedswarm bench swarm``) on every model a peer receives; a model's
    size never changes, so the previous one's buffer fits. A buffer is reused only when the
    pool holds the sole reference to it (CPython counts every holder: a :class:`Message`, a
    tensor or array made with ``frombuffer``, a memoryview), so a body a caller still uses
    is never overwritten. ``max_bytes`` bounds what the pool keeps alive (oldest dropped first)."""

    def __init__(self, max_bytes: int = 128 << 20):
        self.max_bytes = max_bytes
        self.reused = 0
        self._bufs: list = []
        self._lock = threading.Lock()

    def take(self, n: int):
        """A writable ``n``-byte buffer: a free pooled one, else a new one (then pooled)."""
        if n < POOL_MIN_BYTES or n > self.max_bytes:
            return alloc_body(n)
        with self._lock:
            free = [i for i in range(len(self._bufs)) if len(self._bufs[i]) == n and _refs(self._bufs, i) == _LIST_ONLY]
            buf = self._bufs.pop(free[0]) if free else None
            self.reused += buf is not None
        buf = alloc_body(n) if buf is None else buf
        with self._lock:
            self._bufs.append(buf)  # most recent last; the oldest go first
            while sum(len(b) for b in self._bufs) > self.max_bytes:
                self._bufs.pop(0)
        return buf


def _refs(bufs: list, i: int) -> int:
    return sys.getrefcount(bufs[i])


#: What :func:`_refs` counts for an object only a list holds (whatever this interpreter adds for the call
#: itself included, so the test is exact), the pool's test that no one else holds a buffer.
_LIST_ONLY = _refs([bytearray(1)], 0)


def alloc_body(n: int):
    """A fresh writable ``n``-byte buffer. Large ones are anonymous maps advised to use
    transparent huge pages: a fresh 40 MB bytearray costs ~10k page faults (~25 ms, as
    long as the transfer itself), 2 MB pages a few dozen."""
    if n < POOL_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return bytearray(n)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    return m


#: Where received bodies come from (one per process, shared by its transports).
BODY_POOL = BodyPool()


class FiniteScan:
    """Whether every float32 of a body is finite, found chunk by chunk while the body
    arrives (each chunk still in cache, the scan overlapping the rest of the transfer)
    rather than in one more pass over the whole body after it: what
    :func:`~fedswarm.swarm.net.payload.read_vector` would otherwise do last. Covers only
    whole values; ``finite`` is final once :meth:`upto` reached the body's length."""

    def __init__(self, body):
        self.view = memoryview(body)
        self.done = 0
        self.finite = True

    def upto(self, end: int) -> None:
        """Scan the values that lie wholly before byte ``end`` and were not scanned yet."""
        end -= end % 4
        if end <= self.done:
            return
        if self.finite:
            import torch  # a peer that receives models has it loaded; the envelope alone does not need it

            from fedswarm.params import all_finite

            self.finite = all_finite(torch.frombuffer(self.view[self.done : end], dtype=torch.float32))
        self.done = end


def float_scan(meta: Any, body, blen: int) -> FiniteScan | None:
    """A scan for a body whose header says it holds float32 values, else None."""
    if blen and blen % 4 == 0 and isinstance(meta, dict) and meta.get("dtype") == "float32":
        return FiniteScan(memoryview(body)[:blen])
    return None
