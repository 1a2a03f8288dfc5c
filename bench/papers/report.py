"""Verdicts, ``papers.json``, one PNG per claim and ``docs/reproductions.md``.

A claim's measurement is a list of :class:`Check` (a number, a comparison, a threshold);
the verdict is computed from them and nothing else:

- **reproduced**: every check passes;
- **direction only**: the checks marked ``direction`` pass (the method moves the way the
  paper says: less traffic, fewer rounds, faster) but some figure is missed;
- **not reproduced**: a direction check fails, or a value could not be measured (None).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Check", "Measured", "verdict", "seed_stats", "write_json", "write_doc", "write_plot", "combine", "VERDICTS"]

VERDICTS = ("reproduced", "direction only", "not reproduced")
_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


@dataclass
class Check:
    """``value op threshold``, e.g. ``uplink ratio >= 15``. ``direction``: part of the
    paper's direction (a 'direction only' verdict needs these to pass)."""

    name: str
    value: float | None
    op: str
    threshold: float
    direction: bool = False
    unit: str = ""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"check '{self.name}': unknown comparison '{self.op}' (use one of {list(_OPS)})")

    @property
    def passed(self) -> bool:
        if self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            return False
        return bool(_OPS[self.op](self.value, self.threshold))

    def text(self) -> str:
        v = "n/a" if self.value is None else f"{self.value:.4g}"
        return f"{self.name} = {v}{self.unit} (need {self.op} {self.threshold:g}{self.unit}: " \
               f"{'pass' if self.passed else 'FAIL'})"


@dataclass
class Measured:
    """What one claim's miniature measured."""

    ours: str  # one line: our figure
    checks: list[Check]
    setting: str  # what we ran
    series: dict[str, list[list[float]]] = field(default_factory=dict)  # label -> [[x, y], ...]
    xlabel: str = ""
    ylabel: str = ""
    rows: list[dict] = field(default_factory=list)  # the arms' raw numbers
    note: str = ""  # findings: why a figure is missed, with the evidence


def verdict(checks: list[Check]) -> str:
    """The verdict that follows from ``checks`` (see the module docstring)."""
    if not checks:
        return "not reproduced"
    if all(c.passed for c in checks):
        return "reproduced"
    direction = [c for c in checks if c.direction]
    if direction and all(c.passed for c in direction):
        return "direction only"
    return "not reproduced"


def seed_stats(values: list[float]) -> dict[str, Any]:
    """Mean and spread (sample standard deviation; 0 for one seed) of per-seed values."""
    if not values:
        return {"mean": None, "std": None, "n": 0, "values": []}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": list(values)}


def _entry(claim, m: Measured, png: str, mode: str, command: str) -> dict[str, Any]:
    return {
        "id": claim.id, "mode": mode, "command": command,
        "title": claim.title, "paper": claim.paper, "paper_figure": claim.paper_figure,
        "target": claim.target, "differs": claim.differs, "setting": m.setting, "ours": m.ours,
        "checks": [{**asdict(c), "passed": c.passed} for c in m.checks], "verdict": verdict(m.checks),
        "note": m.note, "png": png, "rows": m.rows,
    }


def write_json(path: Path, mode: str, results: list[tuple[Any, Measured]], meta: dict) -> list[dict]:
    entries = [_entry(c, m, f"papers_{c.id}.png", mode, meta["command"]) for c, m in results]
    path.write_text(json.dumps({"mode": mode, **meta, "runs": [{"mode": mode, **meta}], "claims": entries},
                               indent=1, default=str))
    return entries


def combine(sources: list[Path], out_dir: Path, order: list[str]) -> dict:
    """Merge the ``papers.json`` of several runs (a later source wins for a claim it also
    ran) into ``out_dir``: ``papers.json``, the claims' PNGs and ``reproductions.md``. Each
    claim keeps the mode and command of the run that measured it; nothing is re-computed
    but the verdicts, which are checked against the checks."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    runs, by_id = [], {}
    for src in sources:
        data = json.loads((Path(src) / "papers.json").read_text())
        runs += data.get("runs") or [{k: v for k, v in data.items() if k != "claims"}]
        for e in data["claims"]:
            for key in ("mode", "command"):  # runs written before claims carried their own
                if key not in e:  # (a combined source has no top-level command: its claims carry theirs)
                    e[key] = data[key]
            checks = [Check(**{k: c[k] for k in ("name", "value", "op", "threshold", "direction", "unit")})
                      for c in e["checks"]]
            if verdict(checks) != e["verdict"]:
                raise ValueError(f"{src}: claim '{e['id']}' says {e['verdict']!r} but its checks give "
                                 f"{verdict(checks)!r}")
            by_id[e["id"]] = e
            png = Path(src) / e["png"]
            if png.exists() and png.resolve() != (out_dir / e["png"]).resolve():
                shutil.copyfile(png, out_dir / e["png"])
    # a run listed again (a combined source) or whose command and mode a later run repeats measured
    # the same claims, all superseded: only the last is listed
    runs = [r for i, r in enumerate(runs)
            if not any((q.get("command"), q.get("mode")) == (r.get("command"), r.get("mode")) for q in runs[i + 1:])]
    entries = [by_id[i] for i in order if i in by_id]
    modes = sorted({e["mode"] for e in entries})
    merged = {"mode": "+".join(modes), "runs": runs, "claims": entries}
    (out_dir / "papers.json").write_text(json.dumps(merged, indent=1, default=str))
    write_doc(out_dir / "reproductions.md", merged["mode"], entries, runs)
    return merged


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write_doc(path: Path, mode: str, entries: list[dict], runs: list[dict]) -> None:
    """``reproductions.md``: the runs it comes from, the table, then one section per claim."""
    counts = {v: sum(e["verdict"] == v for e in entries) for v in VERDICTS}
    lines = [
        "# Paper claims reproduced in miniature",
        "",
        "<!-- generated by `fedswarm bench papers`; do not edit by hand -->",
        "",
        f"Mode: **{mode}**. Every figure below comes from the run(s) listed; verdicts are computed from the "
        "checks (reproduced: all pass; direction only: the direction checks pass; not reproduced: otherwise). "
        "Accuracy gaps under 2 points (against FedAvg: also within 1 point of the target) are averaged over 3 "
        "seeds in full mode, 1 in quick mode (mean ± sample "
        "std). Times are simulated (the time model), bytes measured on serialized messages; wall times were "
        "taken on a shared, loaded machine.",
        "",
    ]
    for r in runs:
        lines.append(f"- `{r['command']}` (mode: **{r['mode']}**; claims {', '.join(r.get('claims_run', []))}) "
                     f"on {r['date']}, {r['wall_s']:.0f} s wall, {r['load']}")
    lines += [
        "",
        f"Summary: {counts['reproduced']} reproduced, {counts['direction only']} direction only, "
        f"{counts['not reproduced']} not reproduced, of {len(entries)} claims.",
        "",
        "| claim | paper's figure | ours | mode | verdict |",
        "|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(f"| [{_cell(e['title'])}](#{e['id']}) | {_cell(e['paper_figure'])} | {_cell(e['ours'])} "
                     f"| {e['mode']} | **{e['verdict']}** |")
    for e in entries:
        lines += [
            "", f"<a id=\"{e['id']}\"></a>", f"## {e['title']}", "",
            f"- **Paper**: {e['paper']}",
            f"- **Paper's figure**: {e['paper_figure']}",
            f"- **Target here**: {e['target']}",
            f"- **Setting**: {e['setting']}",
            f"- **Differs from the paper's setting**: {e['differs']}",
            f"- **Ours** ({e['mode']}: `{e['command']}`): {e['ours']}",
            f"- **Verdict**: **{e['verdict']}**",
            "- **Checks**:",
        ]
        for c in e["checks"]:
            v = "n/a" if c["value"] is None else f"{c['value']:.4g}"
            lines.append(f"  - {c['name']} = {v}{c['unit']} (need {c['op']} {c['threshold']:g}{c['unit']}"
                         f"{', direction' if c['direction'] else ''}): {'pass' if c['passed'] else 'FAIL'}")
        if e["note"]:
            lines.append(f"- **Findings**: {e['note']}")
        lines.append(f"- Plot: `{e['png']}` (in the bench's output folder)")
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, claim, m: Measured) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for i, (label, pts) in enumerate(m.series.items()):
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=2, linewidth=1.3,
                    color=f"C{i % 10}", label=label)
    if m.series:
        ax.legend(fontsize=7)
    ax.set_xlabel(m.xlabel)
    ax.set_ylabel(m.ylabel)
    ax.grid(True, alpha=0.3)
    ax.set_title(claim.title, fontsize=9)
    bx.axis("off")  # the checks as text: a bar of value/threshold means nothing at threshold 0
    for i, c in enumerate(m.checks):
        bx.text(0.0, 0.92 - 0.1 * i, ("pass  " if c.passed else "FAIL  ") + c.text().split(" (need")[0]
                + f"  (need {c.op} {c.threshold:g}{c.unit})", color="C2" if c.passed else "C3", fontsize=7,
                transform=bx.transAxes, family="monospace")
    bx.set_title(f"verdict: {verdict(m.checks)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
