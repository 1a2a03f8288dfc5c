"""A real Ray cluster on loopback for the tests (:func:`fedswarm.bench.ray_cluster.local_ray_cluster`):
``ray start --head`` and, with ``nodes > 1``, more ``ray start --address`` nodes joining it,
stopped at the end; a cluster that cannot start fails the test with Ray's words."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from fedswarm.bench.ray_cluster import local_ray_cluster


@contextlib.contextmanager
def ray_cluster(nodes: int = 1, cpus: int = 2) -> Iterator[tuple[str, str]]:
    """Yield ``(address, temp_dir)`` of a cluster of ``nodes`` nodes of ``cpus`` CPUs each."""
    try:
        cluster = local_ray_cluster(nodes, cpus)
        address, temp_dir = cluster.__enter__()
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(str(exc))
    try:
        yield address, temp_dir
    finally:
        cluster.__exit__(None, None, None)
