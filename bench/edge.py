"""Weak devices: PVT against all-variable training, ProgFed against FedAvg, HL node selection.

1. **PVT vs AVT** (``digits-cnn4``, SGD with momentum so optimizers keep state): FedAvg
   training every variable against PVT training a quarter of the tensors per client and
   round with 2x (full mode also 1x and 4x) the local steps. Uplink bytes are measured on
   the serialized replies. *Peak client memory* is measured, not estimated, in a fresh
   subprocess (glibc ``MALLOC_MMAP_THRESHOLD_=16384``: every tensor buffer is its own
   mapping, returned on free): after one warm-up step on a throwaway model, each arm runs
   real client rounds through the ClientApp; the kernel's high-water mark is reset
   (``/proc/self/clear_refs`` ← 5) and read back. Training's peak: ``VmHWM`` during
   ``LocalTrainer.fit`` minus ``VmRSS`` at its start (gradients, optimizer state,
   activations, temporaries); the whole round's adds decoding the model and encoding the
   reply. Means over nodes (each PVT node trains its own random subset), on
   ``digits-cnn4`` 8x wider (1.55M parameters: at 25k the training state, ~0.2 MB, is
   below what RSS resolves), with oneDNN on (PyTorch's default) and off: its CPU
   convolutions make weight-sized temporaries even of frozen weights.
2. **ProgFed vs FedAvg** (``digits-cnn4``, 4 stages, the paper's schedule T_s = T/8):
   total training FLOPs (``FlopCounterMode``: per example × examples processed; FedAvg's
   counted the same way), two-way bytes, accuracy, and bytes/FLOPs to reach FedAvg's
   final accuracy minus one point.
3. **HL** (``digits-mlp``, 10 nodes, ``dominant:0.8`` as the paper, one epoch per hop): the learned
   selector against ``random`` and ``round_robin``; episodes restart from the initial
   model and end at the target accuracy. Rounds and bytes to target per episode: the
   learned agent over its last episodes (still learning, ε at its floor), the baselines
   over all theirs; an episode that misses the target counts its length (a lower bound).

    fedswarm bench edge --quick --out out/

Writes ``OUT/edge.json`` (the rows) and ``OUT/edge.png``; prints the table.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fedswarm.bench.arms import run_arm, scratch_store, start_bench
from fedswarm.config import RunConfig
from fedswarm.server.recorder import RoundListener
from fedswarm.store import Store
from fedswarm.tasks import TASKS

__all__ = ["run", "peak_client_memory"]

# Until `digits-cnn4` is merged into TASKS, its module:function name reaches it.
CNN = "digits-cnn4" if "digits-cnn4" in TASKS else "fedswarm.tasks.staged:digits_cnn4"
FL = dict(task=CNN, clients=10, fraction=1.0, batch_size=16, lr=0.05, momentum=0.9, seed=0, partition="iid")
# PVT's server step: with 1 (plain averaging) the partial updates of different clients,
# each made with the other variables frozen, overshoot together and accuracy oscillates.
PVT = {"fraction": 0.25, "server_lr": 0.3}
HL = dict(task="digits-mlp", clients=10, partition="dominant:0.8", local_epochs=1, batch_size=32, lr=0.3, seed=0)
HL_TARGET = 0.8
WIDE = "fedswarm.tasks.staged:digits_cnn4_wide"


# --------------------------------------------------------------------------- runs


def _run(cfg: RunConfig, store: Store, listeners: list[RoundListener] | None = None,
         rid: str | None = None) -> tuple[str, list[dict]]:
    """(run id, rounds after round 0) of one run on ``cfg.engine`` (this bench's configs:
    the default, in-process)."""
    arm = run_arm(cfg, store, name=f"bench-edge-{cfg.strategy}", run_id=rid, listeners=listeners,
                  ok=("finished", "stopped"))
    return arm.run_id, arm.trained_rounds


def _accs(rows: list[dict]) -> list[float]:
    return [r["test_accuracy"] for r in rows]


def _first(rows: list[dict], target: float, key: str) -> float | None:
    """Cumulative ``key`` up to the first round at or above ``target`` accuracy."""
    total = 0.0
    for r in rows:
        total += r[key]
        if r["test_accuracy"] >= target:
            return total
    return None


# --------------------------------------------------------------------------- memory

_CHILD = "--memory-child"


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size


def _memory_child(cfgs_json: str, nodes: int, mkldnn: bool = True) -> None:
    """In a fresh process: for each config (arm), the peak extra resident bytes of one
    client round on each of the first ``nodes`` nodes. Arms alternate node by node, after
    one shared warm-up."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedswarm.client.app import app
    from fedswarm.params import get_flat
    from fedswarm.sim.inprocess import InProcessGrid
    from fedswarm.strategies import registry
    from fedswarm.train import trainer_for
    from fedswarm.wire import vector_to_arrayrecord

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = mkldnn
    cfgs = [RunConfig.model_validate(c) for c in json.loads(cfgs_json)]
    grids = [InProcessGrid(app, c.clients, run_config=c.to_flat()) for c in cfgs]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grids[0].run.run_id, 1, 0
    trainers = [trainer_for(cfgs[0], i, cfgs[0].clients) for i in range(nodes)]  # data loaded before measuring
    warm = copy.deepcopy(trainers[0].model)  # autograd, kernels and allocator warmed on a throwaway copy
    opt = torch.optim.SGD(warm.parameters(), lr=0.01, momentum=0.9)
    trainers[0].task.objective(warm, trainers[0].x[:16], trainers[0].y[:16]).backward()
    opt.step()
    flat = get_flat(warm)
    del warm, opt
    from fedswarm import train as train_mod

    real_fit = train_mod.LocalTrainer.fit
    probe: dict[str, int] = {}

    def fit(self, *args, **kwargs):  # local SGD's own peak, measured inside the round
        probe["hwm_before_fit"] = _status_bytes("VmHWM:")
        probe["rss_fit"] = _status_bytes("VmRSS:")
        _reset_hwm()
        try:
            return real_fit(self, *args, **kwargs)
        finally:
            probe["fit_peak"] = _status_bytes("VmHWM:") - probe["rss_fit"]

    train_mod.LocalTrainer.fit = fit
    peaks: list[list[int]] = [[] for _ in cfgs]
    rounds: list[list[int]] = [[] for _ in cfgs]
    for i in range(nodes):
        for k, (cfg, grid) in enumerate(zip(cfgs, grids)):
            conf = ConfigRecord({key: v for key, v in cfg.to_flat().items() if key != "policies"})
            conf["server-round"] = 1
            msg = Message(RecordDict({"arrays": vector_to_arrayrecord(flat), "config": conf}), dst_node_id=i + 1,
                          message_type=registry.get(cfg.strategy).message_type)
            for p in trainers[i].model.parameters():
                p.grad = None  # a client starts a round holding no gradients (the trainer is cached)
            gc.collect()
            before = _status_bytes("VmRSS:")
            _reset_hwm()
            replies = list(grid.send_and_receive([msg]))
            rounds[k].append(max(probe["hwm_before_fit"], _status_bytes("VmHWM:")) - before)
            peaks[k].append(probe["fit_peak"])
            if replies[0].has_error():
                raise RuntimeError(replies[0].error.reason)
            del replies, msg
    print(json.dumps({"fit": peaks, "round": rounds}))


def peak_client_memory(cfgs: list[RunConfig], nodes: int = 4, mkldnn: bool = True) -> list[tuple[float, float] | None]:
    """Per config, the mean peak extra resident bytes of (local training, the whole client
    round) over ``nodes`` nodes (see the module docstring); None where /proc cannot reset
    the high-water mark. ``mkldnn = False`` turns off oneDNN, whose CPU convolutions make
    weight-sized temporary copies even of frozen weights."""
    if not os.path.exists("/proc/self/clear_refs"):
        return [None] * len(cfgs)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "16384", "OMP_NUM_THREADS": "1"}
    arg = json.dumps([c.model_dump(mode="json") for c in cfgs])
    out = subprocess.run([sys.executable, "-m", "fedswarm.bench.edge", _CHILD, arg, str(nodes), str(int(mkldnn))],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return [(sum(f) / len(f), sum(r) / len(r)) for f, r in zip(res["fit"], res["round"])]


# --------------------------------------------------------------------------- comparisons


def _fl_rows(comparison: str, arm: str, rr: list[dict], **extra) -> dict:
    return dict(comparison=comparison, arm=arm, rounds=len(rr), final_acc=rr[-1]["test_accuracy"],
                best_acc=max(_accs(rr)), bytes_up=sum(r["bytes_up"] for r in rr),
                bytes_down=sum(r["bytes_down"] for r in rr), curve=_accs(rr),
                cum_up=[sum(r["bytes_up"] for r in rr[: i + 1]) for i in range(len(rr))], **extra)


def _pvt(store: Store, quick: bool, base_cfg: RunConfig, base: list[dict]) -> list[dict]:
    """PVT arms against the shared FedAvg run (all-variable training)."""
    steps = base_cfg.local_steps
    mults = (2,) if quick else (1, 2, 4)
    cfgs = [base_cfg] + [base_cfg.model_copy(update={"strategy": "pvt", "local_steps": m * steps, "params": PVT})
                         for m in mults]
    rows = [_fl_rows("PVT vs AVT", "AVT (FedAvg)", base)]
    for m, cfg in zip(mults, cfgs[1:]):
        rows.append(_fl_rows("PVT vs AVT", f"PVT {PVT['fraction']:.0%}, {m}x steps", _run(cfg, store)[1]))
    # Memory is probed on the same architecture 8x wider: at 25k parameters a client's
    # training state (~0.2 MB) is below what resident-memory measurement resolves. Two
    # local steps: the peak is reached in the first step and more steps do not raise it.
    probes = [c.model_copy(update={"task": WIDE, "local_steps": 2}) for c in cfgs]
    nodes = 8 if quick else 10
    for row, peak, plain in zip(rows, peak_client_memory(probes, nodes), peak_client_memory(probes, nodes, False)):
        row["peak_train_bytes"], row["peak_round_bytes"] = peak or (None, None)
        row["peak_train_bytes_no_onednn"], row["peak_round_bytes_no_onednn"] = plain or (None, None)
        row["memory_probe"] = f"{WIDE}, 2 local steps, batch {base_cfg.batch_size}, mean of {nodes} nodes"
    b = rows[0]
    for r in rows[1:]:
        mem = (f"train memory {b['peak_train_bytes'] / r['peak_train_bytes']:.2f}x lower "
               f"(oneDNN off {b['peak_train_bytes_no_onednn'] / r['peak_train_bytes_no_onednn']:.2f}x; "
               f"whole round {b['peak_round_bytes'] / r['peak_round_bytes']:.2f}x), "
               if r["peak_train_bytes"] and b["peak_train_bytes"] else "")
        r["note"] = (f"{mem}uplink {b['bytes_up'] / r['bytes_up']:.1f}x lower, "
                     f"acc {100 * (r['final_acc'] - b['final_acc']):+.1f} pts")
    b["note"] = "baseline"
    return rows


def _fedavg_flops(cfg: RunConfig, rows: list[dict], nodes_by_round: dict[int, list[int]]) -> list[float]:
    """FedAvg's training FLOPs per round, counted like ProgFed's (per example × examples)."""
    from fedswarm.algorithms.selection.progfed import samples_processed
    from fedswarm.strategies.edge.progfed import flops_per_sample
    from fedswarm.train import trainer_for

    trainers = [trainer_for(cfg, i, cfg.clients) for i in range(cfg.clients)]
    per = flops_per_sample(trainers[0].model, trainers[0].task.objective, trainers[0].x, trainers[0].y)
    return [per * sum(samples_processed(trainers[pid].num_examples, cfg.batch_size, cfg.local_steps)
                      for pid in nodes_by_round[r["round"]]) for r in rows]


def _progfed(store: Store, base_cfg: RunConfig, base_rid: str, base: list[dict]) -> list[dict]:
    """ProgFed against the shared FedAvg run."""
    nodes: dict[int, list[int]] = {}
    for n in store.node_rounds(base_rid):
        nodes.setdefault(n.round, []).append(int(n.node_id) - 1)  # in-process: node id = partition + 1
    runs = {"fedavg": [dict(r) for r in base]}
    for r, f in zip(runs["fedavg"], _fedavg_flops(base_cfg, base, nodes)):
        r["flops"] = f
    runs["progfed"] = _run(base_cfg.model_copy(update={"strategy": "progfed"}), store)[1]
    rows = []
    for key, arm in (("fedavg", "FedAvg"), ("progfed", "ProgFed (4 stages)")):
        rr = runs[key]
        for r in rr:
            r["two_way"] = r["bytes_up"] + r["bytes_down"]
        rows.append(_fl_rows("ProgFed vs FedAvg", arm, rr, flops=sum(r["flops"] for r in rr),
                             cum_two_way=[sum(x["two_way"] for x in rr[: i + 1]) for i in range(len(rr))],
                             cum_flops=[sum(x["flops"] for x in rr[: i + 1]) for i in range(len(rr))]))
    target = rows[0]["final_acc"] - 0.01
    for row, key in zip(rows, ("fedavg", "progfed")):
        row["target_acc"] = target
        row["two_way_to_target"] = _first(runs[key], target, "two_way")
        row["flops_to_target"] = _first(runs[key], target, "flops")
    fa, pf = rows
    two = lambda r: r["bytes_up"] + r["bytes_down"]  # noqa: E731
    pf["note"] = (f"compute {100 * (1 - pf['flops'] / fa['flops']):.0f}% less, two-way bytes "
                  f"{100 * (1 - two(pf) / two(fa)):.0f}% less, "
                  f"acc {100 * (pf['final_acc'] - fa['final_acc']):+.1f} pts")
    if fa["two_way_to_target"] and pf["two_way_to_target"]:
        pf["note"] += (f"; to {target:.3f}: bytes {100 * (1 - pf['two_way_to_target'] / fa['two_way_to_target']):.0f}%"
                       f", compute {100 * (1 - pf['flops_to_target'] / fa['flops_to_target']):.0f}% less")
    fa["note"] = "baseline"
    return rows


def _hl(store: Store, quick: bool) -> list[dict]:
    episodes = {"learned": 30 if quick else 100, "random": 6 if quick else 20, "round_robin": 2 if quick else 5}
    tail = 8 if quick else 20  # the learned agent's last episodes
    rows = []
    for selector, n_ep in episodes.items():
        cfg = RunConfig(**HL, strategy="hl", rounds=n_ep * 60,
                        params={"selector": selector, "target_accuracy": HL_TARGET, "max_episode_rounds": 60,
                                "epsilon_decay": 4.0 / n_ep})
        holder: dict = {}

        def stop_after(rnd: int, row: dict, n_ep=n_ep, holder=holder) -> None:
            ended = row.get("test_accuracy", 0) >= HL_TARGET or row.get("episode_round") == 60
            if row.get("episode") == n_ep and ended and "rid" in holder:
                store.add_control(holder["rid"], "stop", {})

        holder["rid"] = store.create_run(cfg.model_dump(), name=f"bench-edge-hl-{selector}")
        _, rr = _run(cfg, store, [stop_after], rid=holder["rid"])
        per: dict[int, list[dict]] = {}
        for r in rr:
            per.setdefault(r["episode"], []).append(r)
        stats = []
        for ep in sorted(per)[:n_ep]:
            er = per[ep]
            hit = next((i for i, r in enumerate(er) if r["test_accuracy"] >= HL_TARGET), None)
            n = hit + 1 if hit is not None else len(er)  # not reached: the episode's length, a lower bound
            stats.append(dict(rounds=n, bytes=sum(r["bytes_up"] + r["bytes_down"] for r in er[:n]),
                              hop_cost=sum(r["hop_cost"] for r in er[:n]), reached=hit is not None))
        use = stats[-tail:] if selector == "learned" else stats
        def mean(k: str, use: list[dict] = use) -> float:
            return sum(s[k] for s in use) / len(use)
        rows.append(dict(comparison="HL node selection", arm=selector, episodes=len(stats),
                         measured_episodes=len(use), reached=f"{sum(s['reached'] for s in use)}/{len(use)}",
                         rounds_to_target=mean("rounds"), bytes_to_target=mean("bytes"),
                         hop_cost_to_target=mean("hop_cost"), target_acc=HL_TARGET,
                         episode_rounds=[s["rounds"] if s["reached"] else None for s in stats]))
    rnd = next(r for r in rows if r["arm"] == "random")
    for r in rows:
        if r is not rnd and r["rounds_to_target"] and rnd["rounds_to_target"]:
            r["note"] = f"{100 * (1 - r['rounds_to_target'] / rnd['rounds_to_target']):.0f}% fewer rounds than random"
        r.setdefault("note", "baseline" if r is rnd else "")
    return rows


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """Run the three comparisons; write ``edge.json`` and ``edge.png``; print the table."""
    out_dir = start_bench(out_dir)
    with scratch_store("edge.db") as store:
        base_cfg = RunConfig(**FL, strategy="fedavg", rounds=16 if quick else 48, local_steps=10)
        base_rid, base = _run(base_cfg, store)
        rows = _pvt(store, quick, base_cfg, base) + _progfed(store, base_cfg, base_rid, base) + _hl(store, quick)
    (out_dir / "edge.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out_dir / "edge.png")
    _print(rows)
    return rows


# --------------------------------------------------------------------------- report


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def _print(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="edge: weak devices (in-process engine; bytes measured on serialized messages)")
    cols = ("comparison", "arm", "final acc", "best acc", "uplink MB", "two-way MB", "peak train MB",
            "GFLOPs", "to target: rounds", "to target: MB", "note")
    for c in cols:
        table.add_column(c, justify="left" if c in ("comparison", "arm", "note") else "right")
    for r in rows:
        two = (r["bytes_up"] + r["bytes_down"]) if "bytes_up" in r else None
        rounds = r.get("rounds_to_target")
        to_mb = r.get("bytes_to_target", r.get("two_way_to_target"))
        table.add_row(
            r["comparison"], r["arm"], f"{r['final_acc']:.3f}" if "final_acc" in r else "-",
            f"{r['best_acc']:.3f}" if "best_acc" in r else "-", _mb(r.get("bytes_up")), _mb(two),
            _mb(r.get("peak_train_bytes")), "-" if r.get("flops") is None else f"{r['flops'] / 1e9:.1f}",
            "-" if rounds is None else f"{rounds:.1f} ({r['reached']})", _mb(to_mb), r.get("note", ""))
    console = Console()
    (console if console.is_terminal else Console(width=220)).print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))
    for r in (r for r in rows if r["comparison"] == "PVT vs AVT"):
        ax[0].plot([b / 1e6 for b in r["cum_up"]], r["curve"], marker=".", label=r["arm"])
    ax[0].set(title="PVT vs AVT", xlabel="cumulative uplink MB", ylabel="test accuracy")
    for r in (r for r in rows if r["comparison"] == "ProgFed vs FedAvg"):
        ax[1].plot([b / 1e6 for b in r["cum_two_way"]], r["curve"], marker=".", label=r["arm"])
        ax[2].plot([f / 1e9 for f in r["cum_flops"]], r["curve"], marker=".", label=r["arm"])
    ax[1].set(title="ProgFed vs FedAvg", xlabel="cumulative two-way MB", ylabel="test accuracy")
    ax[2].set(title="ProgFed vs FedAvg", xlabel="cumulative training GFLOPs", ylabel="test accuracy")
    for r in (r for r in rows if r["comparison"] == "HL node selection"):
        eps = r["episode_rounds"]
        ax[3].plot(range(1, len(eps) + 1), [60 if e is None else e for e in eps], marker=".", label=r["arm"])
    ax[3].set(title=f"HL: rounds to {HL_TARGET:.0%} per episode", xlabel="episode", ylabel="rounds (60 = not reached)")
    for a in ax:
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover - the memory probe's child process
    if len(sys.argv) == 5 and sys.argv[1] == _CHILD:
        _memory_child(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
    else:
        sys.exit("run it with: fedswarm bench edge [--quick]")
