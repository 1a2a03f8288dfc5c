"""The benchmark registry behind ``fedswarm bench NAME``.

Each benchmark is a module with ``run(out_dir: Path, quick: bool) -> list[dict]`` that
prints its table and writes ``out_dir/NAME.json`` and ``out_dir/NAME.png``.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from rich.console import Console
from rich.markup import escape

__all__ = ["BENCHMARKS", "run_benchmark"]

BENCHMARKS = {
    "engines": "fedswarm.bench.engines",
    "engines-ray": "fedswarm.bench.engines_ray",
    "codecs": "fedswarm.bench.codecs",
    "compression": "fedswarm.bench.compression",
    "decentralized": "fedswarm.bench.decentralized",
    "edge": "fedswarm.bench.edge",
    "dashboard": "fedswarm.bench.dashboard",
    "dashboard-runs": "fedswarm.bench.dashboard_runs",
    "ingest": "fedswarm.bench.ingest",
    "swarm": "fedswarm.bench.swarm",
    "robust": "fedswarm.bench.robust",
    "privacy": "fedswarm.bench.privacy",
    "papers": "fedswarm.bench.papers",
    "footprint": "fedswarm.bench.footprint",
    "async": "fedswarm.bench.async_fedbuff",
    "secagg": "fedswarm.bench.secagg",
    "minibatch": "fedswarm.bench.minibatch",
}


def run_benchmark(name: str, out: Path, *, quick: bool, console: Console, device: str = "cpu",
                  profile: bool = False) -> list[dict]:
    from fedswarm.extras import MissingExtra, require

    try:
        require("sim", f"fedswarm bench {name}", modules=("matplotlib",))
        mod = importlib.import_module(BENCHMARKS[name])
    except MissingExtra as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise SystemExit(1) from None
    except ImportError as exc:
        console.print(f"[bold red]error:[/] benchmark '{name}' is not available: {exc}")
        raise SystemExit(1) from None
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if device != "cpu":
        if "device" not in inspect.signature(mod.run).parameters:
            console.print(f"[bold red]error:[/] benchmark '{name}' has no --device option")
            raise SystemExit(2)
        from fedswarm.errors import ConfigError
        from fedswarm.train import check_node_device

        try:
            check_node_device(device)
        except ConfigError as exc:
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise SystemExit(2) from None
        kwargs["device"] = device
    if profile:
        if "profile" not in inspect.signature(mod.run).parameters:
            console.print(f"[bold red]error:[/] benchmark '{name}' has no --profile option")
            raise SystemExit(2)
        kwargs["profile"] = True
    rows = mod.run(out, quick=quick, **kwargs)
    console.print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return rows
