"""What a node reports about its device each round: time, speed, memory, power and heat.

Each reader takes the root of the file system it reads (``/`` on a real node; a fake tree
made under ``tmp_path`` in the tests), reads the kernel's own files (``/proc/self/status``,
``/proc/cpuinfo``, ``/sys/class/power_supply``, ``/sys/class/thermal``) and returns ``None``
when the source is missing or unreadable: a value the OS does not expose is ABSENT from the
report, never guessed. No heavy imports: the accelerator is read from torch only when the
process has already imported it (a node that trains has).

The report's keys (the contract with the run store and the dashboard): ``train_s``,
``examples_per_s``, ``peak_rss_mb``, ``cpu_count``, ``cpu_model``, ``accelerator``,
``accelerator_mem_mb``, ``battery_pct``, ``power_source``, ``cpu_temp_c``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["TELEMETRY_KEYS", "peak_rss_mb", "cpu_model", "battery", "cpu_temp_c", "accelerator", "device_info",
           "round_telemetry"]

TELEMETRY_KEYS = ("train_s", "examples_per_s", "peak_rss_mb", "cpu_count", "cpu_model", "accelerator",
                  "accelerator_mem_mb", "battery_pct", "power_source", "cpu_temp_c")

# Thermal zone types that measure the CPU package or cores (x86, ARM SoCs such as the Raspberry Pi's).
_CPU_ZONES = ("x86_pkg_temp", "cpu-thermal", "cpu_thermal", "soc_thermal", "cpu", "coretemp", "k10temp",
              "acpitz")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def peak_rss_mb(root: str | os.PathLike = "/") -> float | None:
    """This process's peak resident memory (``VmHWM`` of ``/proc/self/status``) in MiB."""
    text = _read(Path(root) / "proc/self/status")
    for line in (text or "").splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            try:
                kib = float(parts[1])
            except (IndexError, ValueError):
                return None
            return round(kib / 1024.0, 1)
    return None


def cpu_model(root: str | os.PathLike = "/") -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (``model name`` on x86, ``Model`` or
    ``Hardware`` on ARM boards)."""
    text = _read(Path(root) / "proc/cpuinfo")
    found: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if sep and value and key in ("model name", "Model", "Hardware", "cpu model") and key not in found:
            found[key] = value
    for key in ("model name", "Model", "cpu model", "Hardware"):
        if key in found:
            return found[key][:200]
    return None


def battery(root: str | os.PathLike = "/") -> dict[str, Any]:
    """``battery_pct`` (the first battery's ``capacity``) and ``power_source`` (``ac`` when a
    mains/USB supply is online, ``battery`` when a battery is there and none is, else left
    out) from ``/sys/class/power_supply``. ``FEDSWARM_FAKE_BATTERY=N`` (tests, read here only) reports
    ``battery_pct = N`` whatever the battery says."""
    base = Path(root) / "sys/class/power_supply"
    try:
        supplies = sorted(p for p in base.iterdir())
    except OSError:
        supplies = []
    out: dict[str, Any] = {}
    mains_seen, mains_online, has_battery = False, False, False
    for sup in supplies:
        kind = (_read(sup / "type") or "").lower()
        if kind == "battery":
            has_battery = True
            cap = _read(sup / "capacity")
            if cap is not None and "battery_pct" not in out:
                try:
                    out["battery_pct"] = max(0.0, min(100.0, float(cap)))
                except ValueError:
                    pass
        elif kind in ("mains", "usb", "usb_c", "usb_pd", "wireless"):
            online = _read(sup / "online")
            if online is not None:
                mains_seen = True
                mains_online = mains_online or online == "1"
    fake = os.environ.get("FEDSWARM_FAKE_BATTERY")
    if fake:  # tests: this node's battery level, as if its battery said so (with no battery: one is added)
        try:
            out["battery_pct"] = max(0.0, min(100.0, float(fake)))
        except ValueError:
            raise ValueError(f"FEDSWARM_FAKE_BATTERY must be a battery level in percent, got '{fake}'") from None
        has_battery = True
    if mains_online:
        out["power_source"] = "ac"
    elif has_battery and mains_seen:
        out["power_source"] = "battery"
    return out


def cpu_temp_c(root: str | os.PathLike = "/") -> float | None:
    """The CPU's temperature in °C: the first thermal zone of a CPU type (``temp`` is in
    millidegrees), else None."""
    base = Path(root) / "sys/class/thermal"
    try:
        zones = sorted(p for p in base.iterdir() if p.name.startswith("thermal_zone"))
    except OSError:
        return None
    by_type = {}
    for zone in zones:
        kind = (_read(zone / "type") or "").lower()
        by_type.setdefault(kind, zone)
    for kind in _CPU_ZONES:
        zone = by_type.get(kind)
        if zone is None:
            continue
        raw = _read(zone / "temp")
        try:
            return round(float(raw) / 1000.0, 1) if raw is not None else None
        except ValueError:
            return None
    return None


def accelerator() -> dict[str, Any]:
    """The accelerator's name and memory (MiB) if the process has torch loaded and one is
    there; empty otherwise."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return {"accelerator": str(props.name), "accelerator_mem_mb": round(props.total_memory / 2**20, 1)}
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return {"accelerator": "apple-mps"}
    except Exception:  # a broken driver is no accelerator, not a failed round
        return {}
    return {}


_DEVICE: dict[str, Any] | None = None


def device_info(root: str | os.PathLike = "/") -> dict[str, Any]:
    """What does not change while the process runs: CPU count and model, accelerator
    (read once per process for the real root)."""
    global _DEVICE
    if str(root) == "/" and _DEVICE is not None:
        return dict(_DEVICE)
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(root)}
    info.update(accelerator())
    info = {k: v for k, v in info.items() if v is not None}
    if str(root) == "/":
        _DEVICE = dict(info)
    return info


def round_telemetry(train_s: float, examples: int, root: str | os.PathLike = "/") -> dict[str, Any]:
    """One round's telemetry: ``train_s`` seconds of local work in which local SGD processed
    ``examples`` examples (0: not counted, no speed reported), the device, memory, power and
    heat. Keys whose source is missing are left out."""
    seen = examples
    out: dict[str, Any] = {"train_s": round(float(train_s), 6)}
    if train_s > 0 and seen > 0:
        out["examples_per_s"] = round(seen / train_s, 3)
    out.update(device_info(root))
    out["peak_rss_mb"] = peak_rss_mb(root)
    out.update(battery(root))
    out["cpu_temp_c"] = cpu_temp_c(root)
    return {k: v for k, v in out.items() if v is not None}
