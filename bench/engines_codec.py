"""``fedswarm bench engines``'s ``codec`` section: the batched engine's codec runner
(:class:`~fedswarm.sim.batched_compressed.CompressedRounds`) against its compute floor.

``compressed_fedavg`` with its defaults (top-k with error feedback), digits-mlp, one local step
(batch 16, lr 0.3), ``--fraction 1.0``, federated evaluation off, 3 rounds, at 10,000 and 100,000
clients (``--quick``: 2,000): client-rounds per second over the steady rounds (the median round
after the first), wall and process CPU seconds, as the ``scale`` section's cells
(:mod:`fedswarm.bench.engines_scale`: each cell a fresh interpreter on one torch thread, its
peak resident memory sampled). Rows per population:

- ``now``: this checkout;
- ``before``: the same cell on another checkout's code, with ``FEDSWARM_BENCH_BEFORE=CHECKOUT``
  (``git archive main | tar -x -C /tmp/before``), run in turn with ``now`` so both see the
  same machine load;
- ``compute floor``: :func:`~fedswarm.bench.engines_scale.compute_floor` of that population (one
  plain torch forward and backward pass over the round's examples; the codec's own work, top-k
  and its decoding, is not in it), measured between the cells.

``repeats`` (2; quick 1) runs of every cell, interleaved; each row gives its best steady round.
``FEDSWARM_BENCH_ENGINES_SECTION=codec`` runs this section alone. Written to
``DIR/engines-codec.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedswarm.bench.engines_scale import BASE, BEFORE_ENV, _cell, compute_floor

__all__ = ["run_codec"]

SPEC = dict(BASE, strategy="compressed_fedavg", rounds=3, eval_every=4)


def run_codec(out_dir: Path, quick: bool = False, console: Console | None = None,
              populations: list[int] | None = None, repeats: int | None = None) -> list[dict]:
    """The section's rows (see the module's docstring); writes engines-codec.json."""
    from fedswarm.bench.dashboard_runs import source_tree

    console = console or Console(width=200)
    populations = populations or ([2_000] if quick else [10_000, 100_000])
    repeats = repeats or (1 if quick else 2)
    before = os.environ.get(BEFORE_ENV) or None
    labels = (["before"] if before else []) + ["now"]
    runs: dict[tuple[str, int], list[dict]] = {(label, n): [] for label in labels for n in populations}
    floors: dict[int, list[tuple[float, float]]] = {n: [] for n in populations}
    with tempfile.TemporaryDirectory() as tmp:
        tree = source_tree(Path(before), Path(tmp) / "before") if before else None
        for rep in range(repeats):
            for n in populations:
                for label in labels:
                    console.print(f"[dim]engines codec: {label} ({n:,} clients), run {rep + 1} ...[/]")
                    runs[label, n].append(_cell(dict(SPEC, clients=n), tree if label == "before" else None,
                                                timeout_s=1800))
                    _partial(out_dir, runs, floors)
                floors[n].append(compute_floor(n))
                _partial(out_dir, runs, floors)
    rows = []
    for n in populations:
        for label in labels:
            cells = runs[label, n]
            ok = [c for c in cells if c.get("status") == "finished" and c.get("steady_round_s")]
            best = min(ok, key=lambda c: c["steady_round_s"]) if ok else (cells[0] if cells else {})
            row = {"row": label, "code": before if label == "before" else "this checkout", "clients": n,
                   "status": best.get("status"), "s_per_round": best.get("steady_round_s"),
                   "cpu_s_per_round": min((c["steady_cpu_s"] for c in ok if c.get("steady_cpu_s")), default=None),
                   "peak_rss_mb": max((c.get("peak_rss_mb") or 0) for c in cells) if cells else None,
                   "final_test_accuracy": best.get("final_test_accuracy"), "runs": cells}
            rows.append(row)
        walls = [w for w, _ in floors[n]]
        rows.append({"row": "compute floor", "code": "plain torch", "clients": n, "status": "measured",
                     "s_per_round": min(walls) if walls else None,
                     "cpu_s_per_round": min((c for _, c in floors[n]), default=None), "floors": floors[n]})
    for r in rows:
        if r.get("s_per_round"):
            r["client_rounds_per_s"] = r["clients"] / r["s_per_round"]
    _ratios(rows)
    _print(rows, console)
    meta = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "spec": SPEC, "repeats": repeats,
            "before": before}
    (out_dir / "engines-codec.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return rows


def _partial(out_dir: Path, runs: dict, floors: dict) -> None:
    """Every cell measured so far, after each one (``DIR/engines-codec.partial.json``): a long
    run stopped early still leaves what it measured."""
    cells = [{"row": label, "clients": n, "runs": cs} for (label, n), cs in runs.items() if cs]
    cells += [{"row": "compute floor", "clients": n, "floors": fs} for n, fs in floors.items() if fs]
    (out_dir / "engines-codec.partial.json").write_text(json.dumps(cells, indent=2))


def _ratios(rows: list[dict]) -> None:
    """Per population: ``now`` over ``before`` (client-rounds/s) and over the floor, on wall and
    on process CPU seconds (``cpu_`` prefix: what a loaded machine disturbs least)."""
    by = {(r["row"], r["clients"]): r for r in rows}
    for r in rows:
        if r["row"] != "now":
            continue
        before, floor = by.get(("before", r["clients"]), {}), by.get(("compute floor", r["clients"]), {})
        for key, prefix in (("s_per_round", ""), ("cpu_s_per_round", "cpu_")):
            if r.get(key) and before.get(key):
                r[prefix + "x_before"] = before[key] / r[key]
            if r.get(key) and floor.get(key):
                r[prefix + "x_floor"] = r[key] / floor[key]


def _print(rows: list[dict], console: Console) -> None:
    load = os.getloadavg()
    table = Table(title=f"engines codec: batched compressed_fedavg (top-k + EF), digits-mlp, one local step, "
                        f"fraction 1.0 (load {load[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("row", "clients", "client-rounds/s", "s/round", "x before", "x floor", "CPU s/round",
                "CPU x before", "CPU x floor", "peak MB", "note"):
        table.add_column(col)

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(r["row"], f"{r['clients']:,}", f(r.get("client_rounds_per_s"), ",.0f"),
                      f(r.get("s_per_round"), ".3f"), f(r.get("x_before"), ".2f"), f(r.get("x_floor"), ".2f"),
                      f(r.get("cpu_s_per_round"), ".3f"), f(r.get("cpu_x_before"), ".2f"),
                      f(r.get("cpu_x_floor"), ".2f"), f(r.get("peak_rss_mb"), ".0f"),
                      "" if r.get("status") in ("finished", "measured") else str(r.get("status"))[:60])
    console.print(table)
