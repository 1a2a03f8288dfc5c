"""Splitting a task's training pool across clients, through flwr-datasets partitioners.

Specs: ``iid``, ``dirichlet:ALPHA`` (label skew; smaller ALPHA is more skewed) and
``shards:K`` (each client gets K label-sorted shards, McMahan et al. 2017) and ``dominant:P``
(client ``k`` draws a fraction P of its examples from class ``k mod C`` and the rest from the
other classes: the split of Homogeneous Learning's code, where node n holds 400 images of
class n mod 10 and 100 of the others, i.e. ``dominant:0.8``).

``iid`` is computed here, vectorized, as exactly what flwr-datasets gives (the pool
shuffled with ``numpy.random.default_rng(seed).permutation``, then cut into contiguous
near-equal shards; a test holds the two equal), so 100,000 clients take milliseconds.
With more clients than training examples, ``iid`` gives every client one example of the
shuffled pool, cycled (client ``k`` holds example ``perm[k mod n]``): clients then share
examples, which is how a many-client simulation on a small built-in task is defined.
:func:`partition_offsets` returns the split as one flat index array plus offsets, so a
batched engine never builds one array per client.
"""

from __future__ import annotations

import functools
import hashlib
import warnings

import numpy as np

from fedswarm.config import parse_partition

__all__ = ["partition_indices", "partition_offsets"]


def _labels_key(labels: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(labels).tobytes()).hexdigest()


def partition_indices(labels: np.ndarray, spec: str, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Indices into the training pool for each of ``num_partitions`` clients."""
    flat, offsets = partition_offsets(labels, spec, num_partitions, seed)
    return [flat[offsets[k]:offsets[k + 1]] for k in range(num_partitions)]


def partition_offsets(labels: np.ndarray, spec: str, num_partitions: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The split as ``(flat, offsets)``: client ``k`` holds ``flat[offsets[k]:offsets[k + 1]]``
    (int64 indices into the training pool; ``offsets`` has ``num_partitions + 1`` entries)."""
    labels = np.asarray(labels)
    if num_partitions < 1:
        raise ValueError(f"need at least one partition, got {num_partitions}")
    return _cached_offsets(_labels_key(labels), labels.tobytes(), str(labels.dtype), spec, num_partitions, seed)


def iid_offsets(n: int, num_partitions: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized ``iid``: flwr-datasets' split (shuffle, then contiguous shards whose sizes
    differ by at most one, the larger first), or one cycled example per client when
    ``num_partitions > n``."""
    perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
    if num_partitions > n:
        return perm[np.arange(num_partitions) % n], np.arange(num_partitions + 1, dtype=np.int64)
    return perm, np.concatenate([[0], np.cumsum(_even_sizes(n, num_partitions))]).astype(np.int64)


def _even_sizes(n: int, num_partitions: int) -> np.ndarray:
    """``n`` split into sizes that differ by at most one, the larger first."""
    sizes = np.full(num_partitions, n // num_partitions, dtype=np.int64)
    sizes[: n % num_partitions] += 1
    return sizes


def dominant_parts(labels: np.ndarray, num_partitions: int, frac: float, seed: int) -> tuple[np.ndarray, ...]:
    """``dominant:P``: client ``k`` holds a fraction ``frac`` of its examples from class
    ``classes[k mod C]`` (its dominant class; ``classes`` sorted) and the rest from the
    other classes, no example twice.

    Sizes are as near equal as in ``iid`` (``n // K``, the first ``n mod K`` one more). A
    class shared by several clients gives each at most an equal share of its examples; a
    client capped that way keeps the fraction by taking fewer of the others (it is smaller).
    The other classes' leftovers, shuffled, each go to the client whose class differs and
    that still lacks the most; leftovers nobody may take stay unused."""
    labels = np.asarray(labels)
    n = labels.size
    if num_partitions > n:
        raise ValueError(f"dominant:{frac} cannot split {n} training examples across {num_partitions} clients")
    rng = np.random.default_rng(seed)
    classes, label_ix = np.unique(labels, return_inverse=True)
    n_cls = classes.size
    dom = np.arange(num_partitions) % n_cls
    sizes = _even_sizes(n, num_partitions)
    pools = [rng.permutation(np.flatnonzero(label_ix == c)) for c in range(n_cls)]
    owners = np.bincount(dom, minlength=n_cls)
    share = np.array([pools[c].size // max(owners[c], 1) for c in range(n_cls)], dtype=np.int64)
    want = np.rint(frac * sizes).astype(np.int64)
    own = np.minimum(want, share[dom])
    others = np.where(own < want, np.rint(own * (1 - frac) / frac), sizes - want).astype(np.int64)
    if (own + others == 0).any():
        k = int(np.flatnonzero(own + others == 0)[0])
        raise ValueError(f"dominant:{frac} left client {k} with no data (class {classes[dom[k]]} has too few "
                         f"examples for its {owners[dom[k]]} clients); use fewer clients")
    mine: list[np.ndarray] = []
    used = [0] * n_cls
    for k in range(num_partitions):
        c = dom[k]
        mine.append(pools[c][used[c]:used[c] + own[k]])
        used[c] += int(own[k])
    left = rng.permutation(np.concatenate([pools[c][used[c]:] for c in range(n_cls)]))
    deficit = others.astype(np.float64)  # float: -inf marks "may not take this class"
    extra: list[list[int]] = [[] for _ in range(num_partitions)]
    for i in left.tolist():
        if not deficit.any():
            break
        masked = np.where(dom == label_ix[i], -np.inf, deficit)
        k = int(np.argmax(masked))
        if masked[k] > 0:
            extra[k].append(i)
            deficit[k] -= 1
    return tuple(np.concatenate([mine[k], np.asarray(extra[k], dtype=np.int64)]) for k in range(num_partitions))


@functools.lru_cache(maxsize=32)
def _cached_offsets(_key: str, raw: bytes, dtype: str, spec: str, num_partitions: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    kind, arg = parse_partition(spec)
    if kind == "iid":
        flat, offsets = iid_offsets(len(raw) // np.dtype(dtype).itemsize, num_partitions, seed)
    else:
        parts = (dominant_parts(np.frombuffer(raw, dtype=dtype), num_partitions, float(arg), seed)
                 if kind == "dominant" else _cached(_key, raw, dtype, spec, num_partitions, seed))
        sizes = np.array([p.size for p in parts], dtype=np.int64)
        flat = np.concatenate(parts).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return flat, offsets


@functools.lru_cache(maxsize=32)
def _cached(_key: str, raw: bytes, dtype: str, spec: str, num_partitions: int, seed: int) -> tuple[np.ndarray, ...]:
    try:
        from datasets import Dataset
        from flwr_datasets.partitioner import IidPartitioner, ShardPartitioner
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "partitioning needs flwr-datasets: install fedswarm with the 'sim' extra "
            "(pip install 'fedswarm[sim]')"
        ) from exc
    labels = np.frombuffer(raw, dtype=dtype)
    n = labels.size
    if num_partitions > n:
        raise ValueError(f"cannot split {n} training examples across {num_partitions} clients")
    kind, arg = parse_partition(spec)
    ds = Dataset.from_dict({"idx": np.arange(n), "label": labels.astype(np.int64)})
    if kind == "iid":
        part = IidPartitioner(num_partitions=num_partitions)
        ds = ds.shuffle(seed=seed)
    elif kind == "dirichlet":
        part = _dirichlet(ds, num_partitions, float(arg), seed, n)
    else:
        shard_size = n // (num_partitions * int(arg))
        if shard_size < 1:
            raise ValueError(f"shards:{arg} needs at least {num_partitions * int(arg)} examples, there are {n}")
        part = ShardPartitioner(
            num_partitions=num_partitions, partition_by="label", num_shards_per_partition=int(arg),
            shard_size=shard_size, seed=seed,
        )
    if kind != "dirichlet":
        part.dataset = ds
    out = []
    for pid in range(num_partitions):
        idx = np.asarray(_load(part, pid, kind)["idx"], dtype=np.int64)
        if idx.size == 0:
            raise ValueError(f"partition '{spec}' left client {pid} with no data; use fewer clients or a larger ALPHA")
        out.append(idx)
    return tuple(out)


def _dirichlet(ds, num_partitions: int, alpha: float, seed: int, n: int):
    """A Dirichlet partitioner that has found a split where every client has data.

    flwr-datasets resamples until each partition has ``min_partition_size`` examples and
    gives up after 10 tries; with small ALPHA and many clients we relax the minimum
    (down to one example) rather than fail."""
    from flwr_datasets.partitioner import DirichletPartitioner

    wanted = max(1, min(10, n // (4 * num_partitions)))
    last: Exception | None = None
    for min_size in sorted({wanted, max(1, wanted // 2), 1}, reverse=True):
        part = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=alpha,
            min_partition_size=min_size, self_balancing=False, seed=seed,
        )
        part.dataset = ds
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                part.load_partition(0)  # triggers the split
            return part
        except ValueError as exc:
            last = exc
    raise ValueError(
        f"dirichlet:{alpha} could not give each of {num_partitions} clients at least one example "
        f"({last}); use fewer clients or a larger ALPHA"
    )


def _load(part, pid: int, kind: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return part.load_partition(pid)
