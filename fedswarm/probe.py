"""What device a client runs on: accelerator, memory, and a measured training speed."""

from __future__ import annotations

import os
import platform
import time

import torch

__all__ = ["probe", "probe_device_class"]


def probe(measure: bool = True) -> dict:
    """cuda, mps or cpu; memory in GB; and (if ``measure``) the time of one training step
    of a small MLP on a 256-example batch, in milliseconds."""
    info: dict = {"cpus": os.cpu_count() or 1, "machine": platform.machine() or None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device="cuda", name=props.name, memory_gb=round(props.total_memory / 1e9, 1))
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info.update(device="mps", name="apple-mps")
    else:
        info.update(device="cpu", name="cpu")
    if "memory_gb" not in info:
        try:
            pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            info["memory_gb"] = round(pages * size / 1e9, 1)
        except (ValueError, OSError, AttributeError):
            info["memory_gb"] = None
    if measure:
        dev = torch.device(info["device"])
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(256, 256, device=dev), torch.randint(0, 10, (256,), device=dev)
        times = []
        for _ in range(6):
            t = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        info["step_ms"] = round(1000 * sorted(times[1:])[len(times[1:]) // 2], 3)
    return info


def probe_device_class() -> str:
    """A device class name for the time model and per-class policies: ``gpu`` with CUDA,
    ``mps`` on Apple silicon, otherwise ``cpu`` (``edge`` if the machine has under 8 GB)."""
    info = probe(measure=False)
    if info["device"] == "cuda":
        return "gpu"
    if info["device"] == "mps":
        return "mps"
    mem = info.get("memory_gb")
    return "edge" if mem is not None and mem < 8 else "cpu"
