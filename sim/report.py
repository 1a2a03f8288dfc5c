"""Tables and plots for people: run summaries, the run list, the strategy catalog."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.store.liveness import live_status

__all__ = ["summary_table", "runs_table", "catalog", "catalog_tables", "plot_run", "policy_keys", "strategy_table"]


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "—" if x is None else format(x, spec)


def summary_table(result: dict) -> Table:
    s = result["summary"]
    rows = [r for r in result["rounds"] if r["round"] > 0]
    t = Table(title=f"run {result['run_id']} — {s.get('status')}", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    t.add_row("rounds", str(s.get("rounds")))
    t.add_row("final test accuracy", _fmt(s.get("final_test_accuracy")))
    t.add_row("best test accuracy", _fmt(s.get("best_test_accuracy")))
    t.add_row("final test loss", _fmt(rows[-1]["test_loss"] if rows else None))
    if s.get("final_fed_accuracy") is not None:  # federated evaluation: the nodes' own validation data
        t.add_row("final federated accuracy", _fmt(s["final_fed_accuracy"]))
        t.add_row("best federated accuracy", _fmt(s.get("best_fed_accuracy")))
        t.add_row("final federated loss", _fmt(s.get("final_fed_loss")))
    t.add_row("bytes up (total)", _fmt_bytes(s.get("total_bytes_up")))
    t.add_row("bytes down (total)", _fmt_bytes(s.get("total_bytes_down")))
    if s.get("total_bytes_report") is not None:
        t.add_row("model reports (monitoring, not in bytes up)", _fmt_bytes(s["total_bytes_report"]))
    t.add_row("rounds wall time", f"{s.get('wall_s', 0):.2f} s")
    if rows:
        t.add_row("mean round wall time", f"{sum(r['wall_s'] for r in rows) / len(rows):.3f} s")
    if any("consensus_distance" in r for r in result["rounds"]):  # a decentralized run
        # a round without gossip (round 0, or one where no node reported) measured none: "—"
        t.add_row("final consensus distance", _fmt(rows[-1].get("consensus_distance") if rows else None, ".3g"))
    if s.get("sim_time_s") is not None:
        t.add_row("simulated time (time model)", f"{s['sim_time_s']:.2f} s")
    if s.get("epsilon") is not None:
        t.add_row("privacy spent (client level)", f"ε = {s['epsilon']:.3f} at δ = {s.get('delta'):g}")
    if s.get("epsilon_example") is not None:
        t.add_row("privacy spent (example level)", f"ε = {s['epsilon_example']:.3f} at δ = {s.get('delta_example'):g}")
    if s.get("byzantine_nodes"):
        t.add_row("Byzantine clients",
                  f"{len(s['byzantine_nodes'])} ({s.get('attack')}): nodes {', '.join(s['byzantine_nodes'])}")
    failed = [r["round"] for r in rows if r.get("decode_failed")]
    if failed:
        t.add_row("rounds not decoded", f"{len(failed)} (more liars than the code corrects): {failed[:10]}")
    if s.get("process_wall_s") is not None:
        t.add_row("process wall time", f"{s['process_wall_s']:.2f} s")
    return t


def runs_table(store: Store, results: list[dict]) -> Table:
    runs = [store.get_run(res["run_id"]) for res in results]
    named = any(r.name for r in runs)
    t = Table(title=f"runs in {store.url}")
    cols = ["run"] + (["name"] if named else []) + ["status", "strategy", "task", "engine", "rounds",
                                                    "final acc", "bytes up", "created"]
    for col in cols:
        t.add_column(col, no_wrap=True)
    for res, run in zip(results, runs):
        s = res["summary"]
        cells = [res["run_id"]] + ([run.name or ""] if named else []) + [
            live_status(run), run.strategy, run.task, run.engine,
            f"{s['rounds']}/{run.total_rounds}", _fmt(s.get("final_test_accuracy"), ".3f"),
            _fmt_bytes(s.get("total_bytes_up")), run.created_at.strftime("%m-%d %H:%M"),
        ]
        t.add_row(*cells)
    return t


def policy_keys(entry) -> list[str]:
    """The device-class policy keys (fedswarm/policy.py) a strategy's clients honour, from its
    registry entry (:attr:`~fedswarm.strategies.registry.StrategyEntry.policy_keys`): the
    dashboard refuses a policy that sets any other."""
    return list(entry.policy_keys)


def capabilities(entry) -> dict[str, Any]:
    """What strategy ``entry`` can do, from its registry entry: the engines that run it, its
    batched round runner and the options it takes there, ``--dp``, ``--byzantine``, ``secagg``."""
    from fedswarm.sim.engines import engines_for

    b = entry.batched
    return {"engines": engines_for(entry), "dp": entry.dp, "byzantine": entry.byzantine, "secagg": entry.secagg,
            "batched": None if b is None else {"runner": b.runner if isinstance(b.runner, str) else
                                               getattr(b.runner, "__qualname__", repr(b.runner)),
                                               "dp": b.dp, "byzantine": b.byzantine}}


def strategy_table() -> str:
    """The README's table of every strategy and what it can do (Markdown), from the registry:
    ``fedswarm strategies --markdown`` prints it, and a test holds the README to it."""
    from fedswarm.strategies import registry

    def yes(flag: bool, where: str = "") -> str:
        return ("yes" + (f" ({where})" if where else "")) if flag else "-"

    lines = ["| strategy | kind | engines | `--dp` | `--byzantine` | device-class policy keys |",
             "|---|---|---|---|---|---|"]
    for e in registry.entries():
        cap = capabilities(e)
        b = e.batched
        dp = yes(e.dp, "not batched" if e.dp and not (b and b.dp) else "")
        byz = yes(bool(e.byzantine), "not batched" if e.byzantine and b and not b.byzantine else "")
        keys = ", ".join(f"`{k}`" for k in e.policy_keys) or "-"
        lines.append(f"| `{e.name}` | {e.kind} | {', '.join(cap['engines'])} | {dp} | {byz} | {keys} |")
    return "\n".join(lines) + "\n"


def catalog() -> dict:
    """Every strategy, codec and task with its hyperparameters: the source of the CLI
    listing and the dashboard's new-run form."""
    from fedswarm.strategies import registry
    from fedswarm.tasks import TASKS

    def hp(h) -> dict:
        # ``allowed`` for people; type, bounds and choices so the dashboard can check values.
        return {"name": h.name, "default": h.default, "help": h.help, "allowed": h.allowed(),
                "type": type(h.default).__name__, "ge": h.ge, "le": h.le, "gt": h.gt, "lt": h.lt,
                "choices": list(h.choices) if h.choices is not None else None}

    out: dict[str, Any] = {
        "strategies": [
            {"name": e.name, "description": e.description, "kind": e.kind, "paper": e.paper,
             "message_type": e.message_type, "hyperparams": [hp(h) for h in e.hyperparams],
             "policy_keys": policy_keys(e), "run_defaults": dict(e.run_defaults), **capabilities(e)}
            for e in registry.entries()
        ],
        "codecs": [],
        "tasks": [{"name": t.name, "description": t.description} for t in TASKS.values()],
        "config": RunConfig.model_json_schema(),
    }
    try:
        from fedswarm.algorithms.compression import codecs

        for name, cls in sorted(codecs.CODECS.items()):
            params = getattr(cls, "hyperparams", ()) or ()
            out["codecs"].append({
                "name": name, "description": (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "",
                "hyperparams": [hp(h) if hasattr(h, "allowed") else dict(h) for h in params],
            })
    except ImportError:
        pass
    return out


def catalog_tables(cat: dict) -> list[Table]:
    tables = []
    t = Table(title="strategies (fedswarm sim --strategy NAME --set KEY=VALUE)")
    for col in ("name", "kind", "description", "hyperparameters (default; allowed)"):
        t.add_column(col)
    for s in cat["strategies"]:
        hps = "\n".join(f"{h['name']}={h['default']!r} ({h['allowed']}): {h['help']}" for h in s["hyperparams"]) or "-"
        runs = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in s.get("run_defaults", {}).items())
        takes = [opt for opt, key in (("--dp", "dp"), ("--byzantine", "byzantine")) if s.get(key)]
        runs_on = "engines: " + ", ".join(s.get("engines") or []) + (f"; takes {', '.join(takes)}" if takes else "")
        t.add_row(s["name"], s["kind"], s["description"] + (f"\n(default: {runs})" if runs else "") + f"\n{runs_on}",
                  hps)
    tables.append(t)
    if cat["codecs"]:
        c = Table(title="codecs (for compressed strategies: --set codec=NAME)")
        for col in ("name", "description", "hyperparameters"):
            c.add_column(col)
        for s in cat["codecs"]:
            hps = "\n".join(f"{h['name']}={h['default']!r} ({h['allowed']})" for h in s["hyperparams"]) or "-"
            c.add_row(s["name"], s["description"], hps)
        tables.append(c)
    k = Table(title="tasks (--task NAME)")
    k.add_column("name")
    k.add_column("description")
    for s in cat["tasks"]:
        k.add_row(s["name"], s["description"])
    tables.append(k)
    return tables


def plot_run(result: dict, path: Path) -> Path | None:
    """Test accuracy per round and against cumulative uplink bytes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rounds"] if r["test_accuracy"] is not None]
    if not rows:
        return None
    rounds = [r["round"] for r in rows]
    acc = [r["test_accuracy"] for r in rows]
    cum, total = [], 0
    for r in rows:
        total += r["bytes_up"]
        cum.append(total / 1e6)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(rounds, acc, marker="o")
    a.set_xlabel("round")
    a.set_ylabel("test accuracy")
    a.grid(alpha=0.3)
    b.plot(cum, acc, marker="o")
    b.set_xlabel("cumulative uplink (MB, measured on serialized messages)")
    b.set_ylabel("test accuracy")
    b.grid(alpha=0.3)
    cfg = result.get("config", {})
    fig.suptitle(f"{cfg.get('strategy')} on {cfg.get('task')}: {cfg.get('clients')} clients, {cfg.get('partition')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
