"""The batched engine's memory budget: ``--memory-budget`` parsed, and the default, a safe
share of the free RAM or GPU memory. The client axis is cut into chunks that fit it
(:class:`fedswarm.sim.batched_trainer.BatchedTrainer`). And the run's peak, estimated before it
starts (:func:`estimate_peak`): a run that would not fit is refused with the flag that fits it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fedswarm.errors import ConfigError

__all__ = ["parse_memory_budget", "default_memory_budget", "available_ram", "MemoryEstimate", "estimate_peak",
           "client_bytes", "one_step_client_bytes", "fitting_fraction", "ram_budget", "STATE_BYTES", "state_bytes",
           "sketch_state_bytes", "PROCESS_BYTES"]

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory_budget(spec: str | int | None) -> int | None:
    """``'2GB'``, ``'512MiB'``, ``'300000000'`` -> bytes; None stays None (the default)."""
    if spec is None or isinstance(spec, int):
        return spec
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(spec))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"invalid value for 'memory_budget': '{spec}' (use e.g. 2GB, 512MiB or a byte count)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1_000_000:
        raise ConfigError(f"invalid value for 'memory_budget': '{spec}' is under 1 MB")
    return value


def default_memory_budget(device: torch.device) -> int:
    """A safe share of what is free: half the free GPU memory, or a quarter of the
    available RAM (at most 8 GB, which already holds tens of thousands of small models)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    return ram_budget(available_ram())


def ram_budget(available: int) -> int:
    """The default budget on the CPU out of ``available`` bytes: a quarter, at most 8 GB."""
    return int(min(available * 0.25, 8e9))


def available_ram() -> int:
    """Bytes of RAM available to new work: Linux's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 4 * 2**30


# -- the run's peak, estimated before it starts ------------------------------------------------

#: What the process holds before any of the run's data: Python, torch, Flower and fedswarm's modules
#: (measured: a 20,000-client digits-mlp run peaks at about 330 MB, nearly all of it this).
PROCESS_BYTES = 350 * 10**6

#: Per-client state a round runner keeps between rounds, for a model of ``d`` parameters: bytes of a
#: client that has state (its rows in arrays, :class:`~fedswarm.sim.batched_round.ClientRows`).
#: The sketch runner's depends on the strategy and its hyperparameters: :func:`state_bytes`.
STATE_BYTES: dict[str, Callable[[int], int]] = {
    "codec": lambda d: 4 * d + 16,  # the error-feedback residual [d] (ClientRows: a row and its slot)
    # GTopKRows: the accumulator row [d], plus 600 for the last message's k int64 indices (8 k bytes:
    # enough while k <= 75; GTopKRows' 12 bytes of slots and rounds per client of the population are not counted)
    "global_topk": lambda d: 4 * d + 600,
}


#: ``[C, d]`` float32 tensors a round runner's client step holds at once for a chunk of C clients,
#: beside the chunk's training (upper bounds): the codec's delta, residual, their sum, the encoded
#: and decoded rows; a sketch client's delta, error and momentum rows before and after, its tables
#: and masks (sketched_sgd at 100,000 clients, --fraction 0.01: ~9 rows measured beyond the chunk)
STEP_ROWS: dict[str, int] = {"codec": 6, "global_topk": 6, "sketch": 12}


def state_bytes(runner: str, cfg, d: int) -> tuple[int, int]:
    """What round runner ``runner`` keeps between rounds for run ``cfg`` with a model of ``d``
    parameters: ``(bytes per client that has state, bytes per client of the population)``."""
    if runner == "sketch":  # the Count-Sketch clients' memories (SketchRows)
        return sketch_state_bytes(cfg, d)
    return (STATE_BYTES[runner](d), 0) if runner in STATE_BYTES else (0, 0)


def sketch_state_bytes(cfg, d: int) -> tuple[int, int]:
    """What :class:`~fedswarm.sim.batched_sketched.SketchRows` holds for run ``cfg`` (strategy and
    hyperparameters) with a model of ``d`` parameters: ``(bytes per client that has state, bytes
    per client of the population)``.
    Rows grow by doubling into storage that is not written (not resident) until a client's row
    is: the resident bytes are these."""
    from fedswarm.algorithms.compression.sparse import k_of
    from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS
    from fedswarm.strategies.registry import resolve_params

    client = SKETCH_CLIENTS[cfg.strategy]
    if client.error_key is None:
        return 0, 0
    params = resolve_params(cfg.strategy, cfg.params or {})
    k = k_of(params["density"], d)
    answered = {"sketched_sgd": min(d, int(params.get("candidates", 0)) * k),
                "gs_sgd": k if params.get("exact_values") else 0}.get(cfg.strategy, 0)
    rows = 1 + (client.momentum_key is not None)
    per_client = 4 * d * rows + 4 * answered
    per_population = 4 * rows + 4 + (4 if answered else 0)  # each ClientRows' slots, the sent rounds
    return per_client, per_population


@dataclass
class MemoryEstimate:
    """A batched run's peak memory in parts (bytes), against what is ``available``."""

    parts: dict[str, int]
    available: int
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self) -> bool:
        return self.total <= self.available

    def describe(self) -> str:
        big = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{name} {human(b)}" + (f" ({self.notes[name]})" if name in self.notes else "")
                         for name, b in big)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def client_bytes(d: int, x_numel: int, act_per_example: int, max_steps: int, max_batch: int) -> int:
    """A conservative estimate of one client's working memory in a chunk: parameters,
    gradient, momentum and update ([d] each, a few copies under vmap), its minibatch
    indices, and the activations of one step (forward and backward)."""
    return 4 * (10 * d + 3 * max_steps * max_batch + 4 * max_batch * (x_numel + act_per_example))


def one_step_client_bytes(x_numel: int, act_per_example: int, max_batch: int) -> int:
    """One client's share of a chunk when every client takes one step (no client's model is
    formed: its examples, their activations and gradients)."""
    return 4 * max_batch * (4 + 2 * x_numel + 6 * act_per_example)


def estimate_peak(cfg, *, d: int, x_numel: int, act_per_example: int, n_train: int, n_test: int,
                  runner: str, available: int, memory_budget: int | None = None) -> MemoryEstimate:
    """The peak of a batched run of ``cfg`` (population ``cfg.clients``, ``cfg.fraction`` of it a
    round, ``cfg.rounds`` rounds) for a model of ``d`` parameters: the process, the data and the
    partition, a round's cohort arrays, one chunk of training (at most the memory budget), the
    client step's rows on that chunk (:data:`STEP_ROWS`), and the clients' state
    (:func:`state_bytes`: its bytes for every client that has trained, at most ``rounds x cohort``
    of them, and its bytes per client of the population). Upper bounds where
    a figure depends on the data (policies' batch sizes and steps: the run's own)."""
    population = cfg.clients
    k = max(int(population * cfg.fraction), 1)
    per_client_examples = max(1, -(-n_train // population))
    batch = min(cfg.batch_size, per_client_examples)
    steps = cfg.local_steps if cfg.local_steps is not None else cfg.local_epochs * max(
        1, -(-per_client_examples // cfg.batch_size))
    budget = memory_budget if memory_budget is not None else ram_budget(available)
    one_step = runner == "weighted_mean" and steps == 1 and not cfg.dp  # BatchedTrainer.average's shortcut
    per = (one_step_client_bytes(x_numel, act_per_example, batch) if one_step else
           client_bytes(d, x_numel, act_per_example, steps, batch))
    chunk = min(budget, k * per)
    step = min(k, max(1, chunk // max(per, 1))) * 4 * d * STEP_ROWS.get(runner, 0)  # the client step's rows
    touched = min(population, cfg.rounds * k)
    per_client, per_member = state_bytes(runner, cfg, d)
    state = touched * per_client + population * per_member
    parts = {
        "process": PROCESS_BYTES,
        "data": 4 * (n_train + n_test) * (x_numel + 1),
        "partition": 16 * (population + 1) + 8 * (max(n_train, population) + max(n_test, population)),
        "cohort": k * (9 * steps * batch + 400),  # schedule, minibatch indices, byte sizes, bookkeeping
        "chunk": chunk,
        "client step": step,
        "client state": state,
        "models": 8 * 6 * d,  # the global model, the running sum (float64) and copies
    }
    notes = {"client state": f"{touched:,} clients x {human(per_client)}"} if state else {}
    if chunk == budget:
        notes["chunk"] = "the memory budget"
    return MemoryEstimate(parts, available, notes)


def fitting_fraction(cfg, estimate: Callable[[Any], MemoryEstimate]) -> float | None:
    """The largest of ``cfg.fraction`` / 2, / 4, ... (down to one client a round) whose
    ``estimate`` fits; None if none does."""
    f = cfg.fraction
    while f * cfg.clients >= 2:
        f /= 2
        if estimate(cfg.model_copy(update={"fraction": f})).fits():
            return f
    return None
