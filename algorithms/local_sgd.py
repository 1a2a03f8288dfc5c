"""Local SGD, once for every runtime: the minibatch plan of a round and one SGD step.

Every runtime that trains a client locally (the ClientApp's :class:`~fedswarm.train.LocalTrainer`,
one client at a time; the batched engine's :class:`~fedswarm.sim.batched_trainer.BatchedTrainer`,
a whole cohort on a leading client axis; a decentralized node's
:func:`~fedswarm.algorithms.decentralized.steps.minibatch_gradient`) draws its minibatches
with :func:`minibatch_plan` (the batched trainer with :func:`minibatch_plans`, every client's row
at once, bit for bit the same) and moves its parameters with :func:`sgd_step`, so the same round
seed gives the same examples and the same arithmetic on each of them.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["minibatch_plan", "minibatch_plans", "sort_keys", "sgd_step"]

# splitmix64's increment (2^64 / golden ratio) and its finaliser's multipliers
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (arithmetic mod 2^64)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _mix_int(z: int) -> int:
    """:func:`_mix` of one value as a Python int (one client's states: no array overhead)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * int(_M1)) & _MASK64
    z = ((z ^ (z >> 27)) * int(_M2)) & _MASK64
    return z ^ (z >> 31)


def _as_u64(seeds) -> np.ndarray:
    """Seeds as uint64, each taken mod 2^64 (an int64 tensor's two's complement, a Python int)."""
    if isinstance(seeds, torch.Tensor):
        return seeds.detach().cpu().to(torch.int64).numpy().view(np.uint64).copy()
    arr = np.asarray(seeds)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64)
    if arr.dtype.kind == "i":
        return arr.astype(np.int64).view(np.uint64)
    if arr.dtype == object:  # Python ints past int64
        return np.array([int(s) & _MASK64 for s in arr.ravel()], dtype=np.uint64).reshape(arr.shape)
    raise ValueError(f"seeds must be integers; got dtype {arr.dtype}")


def sort_keys(seeds, perm: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The sort key (uint64) of example ``position`` in permutation ``perm`` of a client whose
    round seed is ``seeds`` (broadcast together): the ``position + 1``-th output of a splitmix64
    stream whose state is the ``perm + 1``-th output of the splitmix64 stream seeded with the
    seed. A counter-based hash of (seed, perm, position): no state, no order of draws, so any
    set of keys comes out of one array expression."""
    with np.errstate(over="ignore"):  # mod 2^64 is the point (numpy warns on 0-d operands)
        client = _mix(_as_u64(seeds) + _GAMMA)
        state = _mix(client + (np.asarray(perm, dtype=np.uint64) + np.uint64(1)) * _GAMMA)
        return _mix(state + (np.asarray(position, dtype=np.uint64) + np.uint64(1)) * _GAMMA)


def minibatch_plans(n, steps, batch_size, seeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's minibatch plan at once: the cohort form of :func:`minibatch_plan`.

    ``n``, ``steps``, ``batch_size`` and ``seeds`` are one entry per client (``[K]``: arrays,
    tensors or lists). Returns ``(pos [K, S, B], size [K, S])`` (int64, ``S = max(steps)``,
    ``B = max(min(batch_size, n))``): client ``k``'s step ``s`` trains on examples
    ``pos[k, s, :size[k, s]]``; steps past the client's own have size 0, and padding is 0.

    The definition: permutation ``e`` of a client's ``n`` examples sorts positions ``0..n-1``
    by :func:`sort_keys` ``(seed, e, position)`` (ties by position); batches of ``batch_size``
    are cut from permutation 0 in order (the last one short when ``batch_size`` does not divide
    ``n``), then from permutation 1 when it is used up, and so on. A client's plan is a function
    of its own ``(n, steps, batch_size, seed)`` alone, whoever else is in the cohort: row ``k``
    equals ``minibatch_plan(n[k], steps[k], batch_size[k], seeds[k])`` bit for bit.

    The work is array operations over the cohort: the keys of every used permutation and a
    stable row-wise sort of them, one per power-of-two width of the clients' data sizes."""
    n = np.asarray(n, dtype=np.int64).reshape(-1)
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    bs = np.asarray(batch_size, dtype=np.int64).reshape(-1)
    seed_u = _as_u64(seeds).reshape(-1)
    k_total = n.size
    if not (steps.size == bs.size == seed_u.size == k_total):
        raise ValueError(f"minibatch_plans needs one n, steps, batch_size and seed per client; got {k_total}, "
                         f"{steps.size}, {bs.size} and {seed_u.size}")
    if k_total and (n.min() < 0 or steps.min() < 0 or bs.min() < 1):
        k = int(np.flatnonzero((n < 0) | (steps < 0) | (bs < 1))[0])
        raise ValueError(f"minibatch_plan needs n >= 0, steps >= 0 and batch_size >= 1; got n={int(n[k])}, "
                         f"steps={int(steps[k])}, batch_size={int(bs[k])} (client {k})")
    s_max = int(steps.max()) if k_total else 0
    b = np.minimum(bs, n)
    b_max = int(b.max()) if k_total else 0
    per_perm = -(-n // bs)  # batches cut from one permutation (0 when n is 0)
    perms = np.where(n > 0, -(-steps // np.maximum(per_perm, 1)), 0)  # permutations each client uses
    seg_len = perms * n  # a client's used permutations, end to end
    base = np.cumsum(seg_len) - seg_len
    total = int(seg_len.sum())
    # every used permutation's local order, client by client and permutation by permutation
    local = np.zeros(total, dtype=np.int64)
    many = np.flatnonzero((n > 1) & (perms > 0))  # one example: its permutation is [0], no key needed
    if many.size:
        # one row per used (client, permutation): its client, permutation number and first flat offset
        seg_client = np.repeat(many, perms[many])
        seg_perm = np.arange(seg_client.size, dtype=np.int64) - np.repeat(np.cumsum(perms[many]) - perms[many],
                                                                            perms[many])
        seg_n = n[seg_client]
        seg_start = base[seg_client] + seg_perm * seg_n
        # rows padded to the next power of two, one sort per width (at most ~log2(max n) of them, each
        # at most twice its examples): padding keys are the largest, and the stable sort puts a real
        # position (< n) before any padding even at an equal key
        width = np.left_shift(1, np.ceil(np.log2(seg_n)).astype(np.int64))
        for w in np.unique(width).tolist():
            rows = np.flatnonzero(width == w)
            t = np.arange(w, dtype=np.int64)[None, :]
            keys = sort_keys(seed_u[seg_client[rows], None], seg_perm[rows, None], t)
            real = t < seg_n[rows, None]
            whole = bool(real.all())  # every row exactly w long (a cohort of equal sizes): no mask
            if not whole:
                keys[~real] = np.iinfo(np.uint64).max
            order = np.argsort(keys, axis=1, kind="stable")  # real positions first, by key
            at = seg_start[rows, None] + t
            local[at if whole else at[real]] = order if whole else order[real]
    # cut the batches: step s of client k is batch s % per_perm of permutation s // per_perm
    s_idx = np.arange(s_max, dtype=np.int64)[None, :]
    pp = np.maximum(per_perm, 1)[:, None]
    first = (s_idx % pp) * bs[:, None]  # [K, S]: the batch's first place in its permutation
    size = np.where((s_idx < steps[:, None]) & (n[:, None] > 0), np.minimum(bs[:, None], n[:, None] - first), 0)
    t = np.arange(b_max, dtype=np.int64)[None, None, :]
    ok = t < size[:, :, None]
    where = base[:, None, None] + (s_idx // pp)[:, :, None] * n[:, None, None] + first[:, :, None] + t
    if total:
        pos = local[np.where(ok, where, 0)]
        pos[~ok] = 0
    else:
        pos = np.zeros(ok.shape, dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)), torch.from_numpy(size.astype(np.int64))


def minibatch_plan(n: int, steps: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a client's ``n`` examples each of its ``steps`` local steps sees.

    Returns ``(pos [steps, b], size [steps])`` (int64, ``b = min(batch_size, n)``): step ``s``
    trains on examples ``pos[s, :size[s]]`` (positions ``0..n-1`` in the client's data; the
    rest of the row is 0). The definition is :func:`minibatch_plans`' (a permutation of the
    ``n`` examples keyed by the seed, batches of ``batch_size`` cut from it in order, the last
    one short when ``batch_size`` does not divide ``n``, a fresh permutation when one is used
    up): this is its one-client row, bit for bit. A client with no examples gets empty batches."""
    if n < 0 or steps < 0 or batch_size < 1:
        raise ValueError(f"minibatch_plan needs n >= 0, steps >= 0 and batch_size >= 1; got n={n}, "
                         f"steps={steps}, batch_size={batch_size}")
    # minibatch_plans' row, without its cohort bookkeeping (one client: its handful of array
    # operations is the cost; tests/test_minibatch_draw.py holds the two equal bit for bit)
    if n == 0:
        return torch.zeros((steps, 0), dtype=torch.int64), torch.zeros(steps, dtype=torch.int64)
    per_perm = -(-n // batch_size)
    perms = max(1, -(-steps // per_perm))
    if n == 1:
        order = np.zeros((perms, 1), dtype=np.int64)
    else:  # sort_keys(seed, e, 0..n-1) with the per-client stages in Python ints
        client = _mix_int(int(seed) + int(_GAMMA))
        states = np.array([_mix_int(client + (e + 1) * int(_GAMMA)) for e in range(perms)], dtype=np.uint64)
        with np.errstate(over="ignore"):
            keys = _mix(states[:, None] + np.arange(1, n + 1, dtype=np.uint64)[None, :] * _GAMMA)
        order = np.argsort(keys, axis=1, kind="stable")  # [perms, n]
    if steps * batch_size <= n:  # the usual case: one permutation covers every step
        pos = order[0, :steps * batch_size].reshape(steps, batch_size)
        return torch.from_numpy(np.ascontiguousarray(pos)), torch.full((steps,), batch_size, dtype=torch.int64)
    padded = np.zeros((perms, per_perm * batch_size), dtype=np.int64)
    padded[:, :n] = order
    pos = padded.reshape(perms * per_perm, batch_size)[:steps, :min(batch_size, n)]
    size = np.minimum(n - np.arange(per_perm, dtype=np.int64) * batch_size, batch_size)
    return torch.from_numpy(np.ascontiguousarray(pos)), torch.from_numpy(np.tile(size, perms)[:steps])


def sgd_step(params: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, lr: torch.Tensor | float,
             momentum: float, active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of SGD with heavy-ball momentum, as ``torch.optim.SGD`` takes it (no
    dampening, weight decay or Nesterov): ``buf = g`` on the first step (``buf`` None), else
    ``momentum * buf + g``; ``params - lr * buf`` (``lr * g`` without momentum). Returns the
    new ``(params, buf)`` (buf None when ``momentum`` is 0); the inputs are not changed.

    Element-wise, so any shape: ``[C, d]`` with ``lr`` ``[C, 1]`` steps C clients at once,
    one parameter tensor with a float ``lr`` one client. ``active`` (bool, broadcastable
    to ``params``) leaves the other rows as they were: parameters and buffer (a client whose
    local steps are done while others' go on)."""
    if momentum:
        new_buf = grad if buf is None else momentum * buf + grad
        if active is not None:
            new_buf = torch.where(active, new_buf, torch.zeros((), device=grad.device) if buf is None else buf)
        grad = new_buf
    else:
        new_buf = None
    step = lr * grad
    if active is not None:
        step = torch.where(active, step, torch.zeros((), device=grad.device))
    return params - step, new_buf
