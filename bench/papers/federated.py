"""Federated and edge claims: 1-bit SGD, Sketched-SGD, FetchSGD, gs-SGD against global
top-k, PVT and ProgFed (HL: ``hl.py``).

Every arm is a real run of fedswarm's strategy objects: on the batched engine where it
serves the strategy (``--engine batched``: every client's local training on one client
axis, the models equal to the in-process engine's in ``tests/test_batched*.py``), else
in-process (fedswarm's ServerApp and ClientApps); each arm's row names its engine. Bytes
are measured on the serialized Flower messages, both phases of two-phase strategies
included.
The compression claims run on ``digits-mlp-wide`` (d = 301,066, ``fedswarm.tasks.large``),
where a sketch of a tenth of the model is still far larger than k log d, and 1-bit SGD
also on ``digits-cnn4`` (d = 25k, small layers) as the issue asks.
"""

from __future__ import annotations

import json
from typing import Any

from fedswarm.bench.arms import bytes_up_curve, run_arm
from fedswarm.bench.papers.report import Check, Measured, seed_stats
from fedswarm.config import RunConfig
from fedswarm.store import Store

__all__ = ["FLRunner", "onebit_cnn4", "onebit_large", "sketched_sgd", "fetchsgd", "gs_sgd_vs_gtopk",
           "pvt", "progfed"]

LARGE = "digits-mlp-wide"
CNN = "digits-cnn4"
# Sketches of about a tenth of the 1.2 MB model (the phase-2 exact values come on top):
# 4·5·5000 = 100 KB; k = density·d coordinates are updated per round.
# No momentum anywhere (FetchSGD's sketched momentum off too): FedAvg, the baseline, has
# none, so the comparison isolates what compression costs. The error accumulators stay.
# Sketched-SGD's second round asks for p2·k exact values: p2 = 4, the strategy's default and
# the value of the paper's own example (dhroth/sketchedsgd); p2 = 2 sent 13.0x less than FedAvg
# but fell 2.14 ± 0.80 points behind it (3 seeds, full run of 2026-11-26).
SKETCHED = {"density": 0.005, "rows": 5, "cols": 4000, "candidates": 4, "momentum": 0.0}
FETCH = {"density": 0.005, "rows": 5, "cols": 5000, "momentum": 0.0}
GS = {"density": 0.005, "rows": 5, "cols": 4000}
# gTop-k at about gs-SGD's bytes per reply (8 bytes per kept value), with the paper's update
# x <- x - eta·G/P (server_lr 1, as gs-SGD's; fedswarm's gtopk defaults to 2, a tuning of ours
# that 2026-11-26's full run of this claim had left on); and at gs-SGD's own k
GTOPK = {"density": 0.025, "server_lr": 1.0}
GTOPK_SAME_K = {"density": GS["density"], "server_lr": 1.0}
SAME_K_TARGET = 0.95  # accuracy both reach in full mode (the rounds to it compare convergence)


def engine_for(cfg: RunConfig) -> str:
    """``batched`` where the batched engine serves ``cfg`` (the same ServerApp strategy and
    client math on a client axis; held to the in-process engine's models by
    ``tests/test_batched*.py``), else ``inprocess``."""
    from fedswarm.errors import ConfigError
    from fedswarm.sim.batched import check_supported

    try:
        check_supported(cfg)
    except ConfigError:
        return "inprocess"
    return "batched"


def on_engine(cfg: RunConfig) -> RunConfig:
    """``cfg`` set to run on :func:`engine_for`'s engine."""
    return cfg.model_copy(update={"engine": engine_for(cfg)})


class FLRunner:
    """Runs (and caches) federated runs: the FedAvg baseline of a setting is run once per
    seed and shared by every claim that compares with it. Each run goes to the batched
    engine where it serves the strategy (:func:`engine_for`), else to the in-process one;
    both run the strategy's own objects and measure bytes on serialized messages."""

    def __init__(self, store: Store, scale) -> None:
        self.store, self.s = store, scale
        self._cache: dict[str, dict] = {}

    def run(self, task: str, strategy: str, params: dict, *, seed: int, rounds: int, **kw: Any) -> dict:
        setting = dict(task=task, clients=self.s.fl_clients, partition="iid", batch_size=16, lr=0.05,
                       momentum=0.9, local_epochs=1)
        setting.update(kw)
        cfg = RunConfig(strategy=strategy, params=params, rounds=rounds, seed=seed, **setting)
        cfg = on_engine(cfg)
        key = json.dumps(cfg.model_dump(), sort_keys=True, default=str)
        if key in self._cache:
            return self._cache[key]
        rows = run_arm(cfg, self.store, name=f"bench-papers {strategy} on {task}").trained_rounds
        curve = bytes_up_curve(rows)
        up = curve[-1][0]
        out = {"strategy": strategy, "params": params, "task": task, "engine": cfg.engine, "seed": seed,
               "rounds": rounds,
               "final_acc": rows[-1]["test_accuracy"], "bytes_up": up,
               "bytes_down": sum(r["bytes_down"] or 0 for r in rows), "curve": curve}
        self._cache[key] = out
        return out

    def versus(self, task: str, strategy: str, params: dict, rounds: int, need_gap: float, **kw: Any) -> dict:
        """``strategy`` against FedAvg on ``task``: accuracy gap in points and uplink ratio
        (seed 0). The gap is re-measured over 3 seeds when the first seed's is under 2 points
        or within 1 point of ``need_gap``, the claim's threshold: one seed's spread (~0.5-1
        point here) could flip that verdict. ``kw``: settings."""
        base = self.run(task, "fedavg", {}, seed=0, rounds=rounds, **kw)
        arm = self.run(task, strategy, params, seed=0, rounds=rounds, **kw)
        gaps = [100 * (arm["final_acc"] - base["final_acc"])]
        if abs(gaps[0]) < 2.0 or abs(gaps[0] - need_gap) < 1.0:
            for seed in range(1, self.s.seeds_small_gap):
                b = self.run(task, "fedavg", {}, seed=seed, rounds=rounds, **kw)
                a = self.run(task, strategy, params, seed=seed, rounds=rounds, **kw)
                gaps.append(100 * (a["final_acc"] - b["final_acc"]))
        return {"base": base, "arm": arm, "gap": seed_stats(gaps), "ratio": base["bytes_up"] / max(1, arm["bytes_up"])}

    def edge_base(self) -> tuple[RunConfig, str, list[dict]]:
        """``bench/edge.py``'s FedAvg run on digits-cnn4 (AVT), shared by PVT and ProgFed."""
        if "edge" not in self._cache:
            from fedswarm.bench import edge

            cfg = RunConfig(**edge.FL, strategy="fedavg", rounds=self.s.edge_rounds, local_steps=10)
            rid, base = edge._run(cfg, self.store)
            self._cache["edge"] = (cfg, rid, base)
        return self._cache["edge"]


def _vs_measured(v: dict, label: str, need_ratio: float, need_gap: float, setting: str, differs_note: str = ""
                 ) -> Measured:
    g = v["gap"]
    return Measured(
        ours=f"{g['mean']:+.2f} ± {g['std']:.2f} pts ({g['n']} seed(s)) at {v['ratio']:.1f}x less uplink",
        checks=[Check("accuracy vs FedAvg", g["mean"], ">=", need_gap, unit=" pts"),
                Check("uplink ratio vs FedAvg", v["ratio"], ">=", need_ratio, unit="x"),
                Check("less uplink than FedAvg", v["ratio"], ">", 1.0, direction=True, unit="x"),
                Check("accuracy within 5 pts", g["mean"], ">=", -5.0, direction=True, unit=" pts")],
        setting=setting + _engines(v["base"]["engine"], v["arm"]["engine"]),
        series={"FedAvg fp32": v["base"]["curve"], label: v["arm"]["curve"]},
        xlabel="cumulative uplink bytes (measured)", ylabel="test accuracy",
        rows=[v["base"], v["arm"], {"arm": "gap", "gap_points": g, "uplink_ratio": v["ratio"]}],
        note=differs_note)


def _engines(*engines: str) -> str:
    """The setting's note of which engine ran the arms."""
    return f"; engine {' and '.join(sorted(set(engines)))} (fedswarm sim --engine)"


def _fl_setting(fl: FLRunner, task: str, rounds: int) -> str:
    return (f"{task}, {fl.s.fl_clients} IID clients, all sampled, {rounds} rounds, 1 local epoch, batch 16, "
            "lr 0.05, momentum 0.9")


# the issue's setting for 1-bit on digits-cnn4: ``fedswarm sim``'s defaults (lr 0.3, 2 local epochs, no momentum)
CNN_SIM = {"lr": 0.3, "momentum": 0.0, "local_epochs": 2}
# The paper's scheme (the verdict's arm): the ``onebit`` strategy, 1-bit with error feedback
# on the way up, the aggregate re-quantized to 1 bit with the server's residual on the way
# down (Seide et al.'s second quantization of each stripe's sum). Scales per block of >= 256
# values both ways (per column, digits-cnn4's 8-row conv columns would pay 64 bits of scales
# per 8 bits of signs).
ONEBIT = {"scale": "block"}
# Uplink only: the same client half, the dense model sent down as in FedAvg.
ONEBIT_UP = {"codec": "onebit", "codec_params": "scale=block"}


def _gap_text(v: dict) -> str:
    g = v["gap"]
    return f"{g['mean']:+.2f} ± {g['std']:.2f} pts ({g['n']} seed(s)) at {v['ratio']:.1f}x less uplink"


def _onebit(fl: FLRunner, task: str, rounds: int, need_ratio: float, setting: str, **kw: Any) -> Measured:
    two = fl.versus(task, "onebit", ONEBIT, rounds, -1.0, **kw)
    up = fl.versus(task, "compressed_fedavg", ONEBIT_UP, rounds, -1.0, **kw)
    m = _vs_measured(two, "1-bit both ways (onebit: the paper's scheme)", need_ratio, -1.0, setting)
    m.ours = "1-bit both ways (the paper's scheme, the verdict's): " + m.ours + \
        "; uplink only (dense downlink): " + _gap_text(up)
    m.series["1-bit uplink only, dense downlink"] = up["arm"]["curve"]
    m.rows += [{**up["arm"], "arm": "compressed_fedavg, 1-bit uplink only (seed 0)"},
               {"arm": "uplink-only gap", "gap_points": up["gap"], "uplink_ratio": up["ratio"]}]
    base, arm = two["base"], two["arm"]
    m.note = (f"Both configurations side by side (seeds {', '.join(str(s) for s in range(two['gap']['n']))} for the "
              f"paper's scheme): the paper's two-stage scheme {_gap_text(two)} and "
              f"{base['bytes_down'] / max(1, arm['bytes_down']):.1f}x less downlink; 1-bit on the uplink only "
              f"{_gap_text(up)}. The verdict uses the paper's scheme (Seide et al. also quantize the aggregate).")
    return m


def onebit_cnn4(fl: FLRunner) -> Measured:
    r = fl.s.fl_rounds_cnn
    return _onebit(fl, CNN, r, 15.0, f"{CNN}, {fl.s.fl_clients} IID clients, all sampled, {r} rounds, 2 local epochs, "
                   "batch 16, lr 0.3, no momentum (fedswarm sim's defaults); onebit strategy (error feedback on "
                   "clients and server, scale=block: columns grouped to >= 256 values) against FedAvg; beside it "
                   "compressed_fedavg with the onebit codec and a dense downlink", **CNN_SIM)


def onebit_large(fl: FLRunner) -> Measured:
    r = fl.s.fl_rounds_large
    return _onebit(fl, LARGE, r, 25.0, _fl_setting(fl, LARGE, r) + "; onebit strategy (error feedback on clients "
                   "and server, scale=block) against FedAvg; beside it compressed_fedavg with the onebit codec and "
                   "a dense downlink")


# The sketching papers compress one minibatch gradient per worker and step (data-parallel
# SGD; FetchSGD: "the gradient on one local minibatch"), for thousands of steps: one local
# step per round, and many rounds, is their regime. With a local epoch per round and a
# handful of rounds, k-sparse updates (0.5% of the coordinates a round) cannot catch up.
SKETCH_SETTING = {"local_steps": 1, "lr": 0.5, "momentum": 0.0}


def _sketch_setting(fl: FLRunner, r: int) -> str:
    return (f"{LARGE}, {fl.s.fl_clients} IID clients, all sampled, {r} rounds of one local minibatch step "
            "(batch 16, lr 0.5, no client momentum: data-parallel SGD as in the papers)")


def sketched_sgd(fl: FLRunner) -> Measured:
    r = fl.s.fl_rounds_sketch
    v = fl.versus(LARGE, "sketched_sgd", SKETCHED, r, -2.0, **SKETCH_SETTING)
    return _vs_measured(v, "Sketched-SGD", 10.0, -2.0, _sketch_setting(fl, r) + f"; sketched_sgd {SKETCHED}")


def fetchsgd(fl: FLRunner) -> Measured:
    r = fl.s.fl_rounds_sketch
    v = fl.versus(LARGE, "fetchsgd", FETCH, r, -2.0, **SKETCH_SETTING)
    return _vs_measured(v, "FetchSGD", 10.0, -2.0, _sketch_setting(fl, r) + f"; fetchsgd {FETCH}")


def _acc_at(curve: list[list[float]], budget: float) -> float | None:
    """Accuracy of the last round whose cumulative uplink is within ``budget`` bytes."""
    got = [acc for up, acc in curve if up <= budget]
    return got[-1] if got else None


def gs_sgd_vs_gtopk(fl: FLRunner) -> Measured:
    r = fl.s.fl_rounds_sketch
    gs = fl.run(LARGE, "gs_sgd", GS, seed=0, rounds=r, **SKETCH_SETTING)
    gt = fl.run(LARGE, "gtopk", GTOPK, seed=0, rounds=r, **SKETCH_SETTING)
    budget = min(gs["bytes_up"], gt["bytes_up"])
    a_gs, a_gt = _acc_at(gs["curve"], budget), _acc_at(gt["curve"], budget)
    gaps = [100 * (a_gs - a_gt)] if a_gs is not None and a_gt is not None else []
    if gaps and abs(gaps[0]) < 2.0:
        for seed in range(1, fl.s.seeds_small_gap):
            g2 = fl.run(LARGE, "gs_sgd", GS, seed=seed, rounds=r, **SKETCH_SETTING)
            t2 = fl.run(LARGE, "gtopk", GTOPK, seed=seed, rounds=r, **SKETCH_SETTING)
            b2 = min(g2["bytes_up"], t2["bytes_up"])
            x, y = _acc_at(g2["curve"], b2), _acc_at(t2["curve"], b2)
            if x is not None and y is not None:
                gaps.append(100 * (x - y))
    g = seed_stats(gaps)
    mean = g["mean"]
    same_k = fl.run(LARGE, "gtopk", GTOPK_SAME_K, seed=0, rounds=r, **SKETCH_SETTING)
    return Measured(
        ours=(f"gs-SGD {mean:+.2f} ± {g['std']:.2f} pts vs global top-k at {budget / 1e6:.1f} MB uplink "
              f"({g['n']} seed(s))" if mean is not None else "no common byte budget"),
        checks=[Check("gs-SGD - gTop-k accuracy at the same uplink", mean, ">=", 0.0, direction=True, unit=" pts")],
        setting=_sketch_setting(fl, r) + f"; gs_sgd {GS} vs gtopk {GTOPK}; accuracy compared at the smaller "
                                            f"of the two runs' total uplink; beside them gtopk {GTOPK_SAME_K} (seed 0)"
                                            + _engines(gs["engine"], gt["engine"], same_k["engine"]),
        series={"gs-SGD": gs["curve"], "gTop-k": gt["curve"], "gTop-k at gs-SGD's k": same_k["curve"]},
        xlabel="cumulative uplink bytes (measured)", ylabel="test accuracy", rows=[gs, gt, same_k, {"gap": g}],
        note=_gs_findings(gs, gt, same_k, r, fl.s.fl_clients))


def _rounds_to(curve: list[list[float]], target: float) -> int | None:
    """The first round (1-based) whose accuracy is >= ``target``."""
    return next((i + 1 for i, (_, acc) in enumerate(curve) if acc >= target), None)


def _gs_findings(gs: dict, gt: dict, same_k: dict, rounds: int, clients: int) -> str:
    """Why gs-SGD trails gTop-k, from the runs' own numbers (seed 0): what a reply costs per
    coordinate it updates, and gTop-k at gs-SGD's k (per-round convergence at equal sparsity)."""
    from fedswarm.algorithms.compression.sparse import k_of
    from fedswarm.params import ParamLayout
    from fedswarm.tasks import get_task

    d = ParamLayout.from_module(get_task(LARGE).model(0)).d
    k_gs, k_gt = k_of(GS["density"], d), k_of(GTOPK["density"], d)  # the codecs' own k

    def per(run: dict, k: int) -> float:  # bytes of one reply per coordinate it updates
        return run["bytes_up"] / (rounds * clients) / k

    to = [_rounds_to(run["curve"], SAME_K_TARGET) for run in (gs, same_k)]
    if None not in to and to[0] != to[1]:
        faster = to[1] < to[0]
    else:  # a run that does not reach the target: the final accuracy decides the wording
        faster = same_k["final_acc"] > gs["final_acc"]
    to = [t or f"not within {rounds}" for t in to]
    return (f"Per coordinate it updates a round, a gs-SGD reply costs {per(gs, k_gs):.0f} bytes (its {GS['rows']} x "
            f"{GS['cols']} table and the {k_gs} exact values, measured) and a gTop-k reply {per(gt, k_gt):.0f} (value "
            f"and index): at the same bytes gTop-k updates {k_gt / k_gs:.1f}x more coordinates a round. At gs-SGD's "
            f"own k ({k_gs}, density {GS['density']}), gTop-k's exact local top-k and tree merge converge "
            f"{'faster' if faster else 'no faster'} per round than the global sketch's top-k (c = "
            f"{GS['cols'] / k_gs:.1f}k columns): rounds to "
            f"{SAME_K_TARGET}: gTop-k {to[1]}, gs-SGD {to[0]}; final accuracy {same_k['final_acc']:.4f} "
            f"vs {gs['final_acc']:.4f}, with {gs['bytes_up'] / max(1, same_k['bytes_up']):.1f}x less uplink for gTop-k "
            "(seed 0). Both apply the plain average (server_lr 1). Accuracy only: the tree all-reduces' time is not "
            "simulated; gs-SGD's algorithm is reconstructed from the abstract (docs/algorithms.md §6d).")


# --------------------------------------------------------------------------- edge (bench/edge.py's arms)


# PVT runs on digits-resnet14 (47 variables): on digits-cnn4 (18) one tensor a client caps
# the expected uplink ratio at 18x. Arms: (fraction of the tensors a client trains, local-step
# multiple); the paper trains "a small subset" of the variables with more local steps. At f =
# 5%, k = 2 of 47 tensors (expected ratio 23.5x before framing); at 2%, k = 1 (47x).
PVT_TASK = "digits-resnet14"
PVT_WIDE = "fedswarm.tasks.deep:digits_resnet14_wide"
PVT_ARMS = {"quick": ((0.05, 4),), "full": ((0.05, 4), (0.02, 4))}
# PVT trains twice the rounds of the other edge claims: the paper compares trained models, and
# at 24 rounds AVT had plateaued since round 11 while PVT 2% (1 tensor of 47 a round) still rose
# (0.958 -> 0.967 over its last 10 rounds; full run of 2026-11-26)
PVT_ROUNDS = 2


def _pvt_cfg(cfg, fraction: float, mult: int):
    from fedswarm.bench import edge

    return on_engine(cfg.model_copy(update={"strategy": "pvt", "local_steps": mult * cfg.local_steps,
                                            "params": {**edge.PVT, "fraction": fraction}}))


def pvt(fl: FLRunner) -> Measured:
    from fedswarm.bench import edge

    cache = fl._cache
    cfg = on_engine(RunConfig(**{**edge.FL, "task": PVT_TASK}, strategy="fedavg",
                              rounds=PVT_ROUNDS * fl.s.edge_rounds, local_steps=10))
    base = edge._run(cfg, fl.store)[1]
    arms = PVT_ARMS["quick" if fl.s.edge_quick else "full"]
    cfgs = [cfg] + [_pvt_cfg(cfg, f, m) for f, m in arms]
    rows = [edge._fl_rows("PVT vs AVT", "AVT (FedAvg)", base)]
    for (f, m), c in zip(arms, cfgs[1:]):
        rows.append(edge._fl_rows("PVT vs AVT", f"PVT {f:.0%}, {m}x steps", edge._run(c, fl.store)[1]))
    # memory on the same architecture 8x wider, 2 local steps (bench/edge.py explains why)
    probes = [c.model_copy(update={"task": PVT_WIDE, "local_steps": 2}) for c in cfgs]
    for row, peak in zip(rows, edge.peak_client_memory(probes, 4 if fl.s.edge_quick else 8)):
        row["peak_train_bytes"] = peak[0] if peak else None
    b = rows[0]

    def checks(r: dict, gap: float | None = None) -> list[Check]:
        mem = (b["peak_train_bytes"] / r["peak_train_bytes"]) if r.get("peak_train_bytes") and \
            b.get("peak_train_bytes") else None
        gap = 100 * (r["final_acc"] - b["final_acc"]) if gap is None else gap
        up = b["bytes_up"] / max(1, r["bytes_up"])
        return [Check("peak training memory, AVT / PVT", mem, ">=", 1.7, unit="x"),
                Check("uplink ratio vs AVT", up, ">=", 20.0, unit="x"),
                Check("accuracy vs AVT", gap, ">=", -1.0, unit=" pts"),
                Check("less memory", mem, ">", 1.0, direction=True, unit="x"),
                Check("less uplink", up, ">", 1.0, direction=True, unit="x")]

    from fedswarm.algorithms.selection.pvt import num_selected
    from fedswarm.tasks import get_task

    sizes = [p.numel() for p in get_task(PVT_TASK).model(0).parameters()]
    ceilings = {f: len(sizes) / num_selected(len(sizes), f) for f, _ in arms}
    scored = [(sum(c.passed for c in checks(r)), r["final_acc"], i) for i, r in enumerate(rows[1:], 1)]
    pick_i = max(scored)[2]
    pick = rows[pick_i]
    # the picked arm's gap over more seeds when it is small (seed 0 above)
    gaps = [100 * (pick["final_acc"] - b["final_acc"])]
    if abs(gaps[0]) < 2.0:
        for seed in range(1, fl.s.seeds_small_gap):
            key = f"pvt-seed-{seed}"
            if key not in cache:
                c0 = cfg.model_copy(update={"seed": seed})
                a0 = edge._run(c0, fl.store)[1][-1]["test_accuracy"]
                a1 = edge._run(_pvt_cfg(c0, *arms[pick_i - 1]), fl.store)[1][-1]["test_accuracy"]
                cache[key] = 100 * (a1 - a0)
            gaps.append(cache[key])
    g = seed_stats(gaps)
    pick["gap_points"] = g
    cs = checks(pick, g["mean"])
    for r in rows[1:]:
        r["checks"] = {c.name: c.value for c in checks(r)[:3]}
    others = "; ".join(f"{r['arm']}: " + ", ".join(f"{k} {v:.3g}" for k, v in r["checks"].items() if v is not None)
                       for r in rows[1:] if r is not pick)
    shown = [c for c in cs[:3] if c.value is not None and c.name != "accuracy vs AVT"]
    return Measured(
        ours=f"{pick['arm']}: " + ", ".join(f"{c.name} {c.value:.3g}{c.unit}" for c in shown)
        + f", accuracy vs AVT {g['mean']:+.2f} ± {g['std']:.2f} pts ({g['n']} seed(s))",
        checks=cs,
        setting=f"{PVT_TASK} (ResNet-14, {len(sizes)} variables, d = {sum(sizes):,}), {edge.FL['clients']} IID "
                f"clients, {cfg.rounds} rounds, 10 local steps (PVT: multiples), batch 16, lr 0.05, momentum 0.9, "
                f"server_lr {edge.PVT['server_lr']}; memory: mean peak of local training over nodes on "
                f"{PVT_TASK} 8x wide; the arm shown is the PVT arm passing most checks (seed 0), its accuracy "
                "gap over 3 seeds when under 2 points" + _engines(*[c.engine for c in cfgs]),
        series={r["arm"]: [[up, a] for up, a in zip(r["cum_up"], r["curve"])] for r in rows},
        xlabel="cumulative uplink bytes (measured)", ylabel="test accuracy", rows=rows,
        note=(f"Other PVT arms (seed 0): {others}. " if others else "") + (
            f"Ceiling: {PVT_TASK} has V = {len(sizes)} variables (tensors of {min(sizes)} to {max(sizes)} values); "
            "a client trains k = max(1, round(f·V)) of them drawn uniformly, so the expected uplink ratio is V/k "
            "before framing: " + ", ".join(f"{ceilings[f]:.1f}x at f = {f:.0%}" for f, _ in arms) + "."))


# ProgFed's stage schedule. The official configs give each stage before the last T_s rounds:
# for its ConvNets (the model family of digits-cnn4) T_s = T/S: EMNIST, 3 stages,
# update-cycle 500 of 1500 rounds; CIFAR-10, 4 stages, 500 of 2000. For ResNet-18 on
# CIFAR-100, T_s = T/(2S) (375 of 3000): the strategy's default. The 63% headline is the
# ConvNet kind of setting (the full model trains the last 1/S of the rounds).
PROGFED_SCHEDULES = (("ConvNet schedule T_s = T/S", 1), ("ResNet schedule T_s = T/(2S)", 2))


def _progfed_arm(fl: FLRunner, cfg, rid: str, base: list[dict], stage_rounds: int) -> tuple[dict, dict]:
    from fedswarm.bench import edge

    nodes: dict[int, list[int]] = {}
    for n in fl.store.node_rounds(rid):
        nodes.setdefault(n.round, []).append(int(n.node_id) - 1)  # in-process: node id = partition + 1
    fa_rounds = [dict(r) for r in base]
    for r, f in zip(fa_rounds, edge._fedavg_flops(cfg, base, nodes)):
        r["flops"] = f
    pf_rounds = edge._run(cfg.model_copy(update={"strategy": "progfed", "params": {"stage_rounds": stage_rounds}}),
                          fl.store)[1]
    rows = []
    for arm, rr in (("FedAvg", fa_rounds), (f"ProgFed (4 stages, T_s = {stage_rounds})", pf_rounds)):
        two = [r["bytes_up"] + r["bytes_down"] for r in rr]
        rows.append(edge._fl_rows("ProgFed vs FedAvg", arm, rr, flops=sum(r["flops"] for r in rr),
                                  cum_two_way=[sum(two[: i + 1]) for i in range(len(rr))]))
    return rows[0], rows[1]


# Full mode runs ProgFed longer than the shared edge runs (24 rounds): with T_s = T/S the full
# model trains only the last quarter, 6 rounds at T = 24 (-3.06 pts, still rising), 24 at T = 96.
PROGFED_ROUNDS = {"full": 96}


def progfed(fl: FLRunner) -> Measured:
    from fedswarm.bench import edge

    cfg, rid, base = fl.edge_base()
    rounds = PROGFED_ROUNDS.get(fl.s.name)
    if rounds and rounds != cfg.rounds:  # its own FedAvg baseline at that length
        cfg = cfg.model_copy(update={"rounds": rounds})
        rid, base = edge._run(cfg, fl.store)
    stages = 4  # digits-cnn4's blocks
    two = lambda r: r["bytes_up"] + r["bytes_down"]  # noqa: E731
    arms = []
    for label, div in PROGFED_SCHEDULES:
        fa, pf = _progfed_arm(fl, cfg, rid, base, max(1, round(cfg.rounds / (div * stages))))
        arms.append((label, fa, pf, 100 * (1 - two(pf) / two(fa)), 100 * (1 - pf["flops"] / fa["flops"]),
                     100 * (pf["final_acc"] - fa["final_acc"])))
    label, fa, pf, saved, flops, gap = arms[0]
    other = "; ".join(f"{lb} ({p['arm']}): {s:.0f}% less two-way traffic, {f:.0f}% less compute, {g:+.2f} pts"
                      for lb, _, p, s, f, g in arms[1:])
    return Measured(
        ours=f"{saved:.0f}% less two-way traffic, {flops:.0f}% less compute, {gap:+.2f} pts ({label})",
        checks=[Check("two-way traffic saved", saved, ">=", 50.0, unit=" %"),
                Check("accuracy vs FedAvg", gap, ">=", -1.0, unit=" pts"),
                Check("less traffic", saved, ">", 0.0, direction=True, unit=" %"),
                Check("less compute", flops, ">", 0.0, direction=True, unit=" %")],
        setting=f"digits-cnn4 (4 stages), {edge.FL['clients']} IID clients, {cfg.rounds} rounds, 10 local steps; "
                f"{label} as in the paper's ConvNet configs (EMNIST: 3 stages, 500 of 1500 rounds each; "
                "CIFAR-10: 4 stages, 500 of 2000); two-way bytes over the whole run",
        series={"FedAvg": [[x, a] for x, a in zip(fa["cum_two_way"], fa["curve"])],
                **{f"ProgFed, {lb}": [[x, a] for x, a in zip(p["cum_two_way"], p["curve"])]
                   for lb, _, p, *_ in arms}},
        xlabel="cumulative two-way bytes (measured)", ylabel="test accuracy", rows=[fa] + [a[2] for a in arms],
        note=f"Other schedule: {other}.")
