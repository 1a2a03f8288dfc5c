"""The batched engine's memory budget: ``--memory-budget`` parsed, and the default, a safe
share of the free RAM or GPU memory. The client axis is cut into chunks that fit it
(:class:`fedswarm.sim.batched_trainer.BatchedTrainer`)."""

from __future__ import annotations

import os
import re

import torch

from fedswarm.errors import ConfigError

__all__ = ["parse_memory_budget", "default_memory_budget", "available_ram"]

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
    return int(min(available_ram() * 0.25, 8e9))


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
