"""``fedswarm bench secagg``: fedswarm's SecAgg+ on the Message API beside Flower's own
SecAgg+ (its legacy ``SecAggPlusWorkflow`` and ``secaggplus_mod``), side by side in one run.

Both protocols run the same way: n virtual nodes in this process on one harness grid
(:class:`WireGrid`, fedswarm's in-process grid that also serializes every message each way,
as a real transport would, and counts its bytes), every node holding a fixed update of d
float32 values, one FedAvg round, the same threshold and neighbourhood (fedswarm's default
degree for n; Flower's ``num_shares`` = degree + 1, its ``reconstruction_threshold`` = t),
the same dropouts (nodes whose reply to the masked-input stage is lost). Arms:

- ``fedswarm``: Flower's Message-API ``FedAvg`` started on ``SecAggGrid`` (fedswarm.server.secagg)
  with ``secagg_mod`` on the ClientApp, as a Flower user would use it;
- ``flower``: Flower's ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with a
  ``LegacyContext`` and ``secaggplus_mod`` on a NumPyClient;
- ``fedswarm-plain`` and ``flower-plain``: the same rounds without secure aggregation (overhead).

Figures per arm: round wall time and process CPU time (``round_cpu_s``: steadier on a shared
machine; ``speedup_vs_flower_cpu`` beside ``speedup_vs_flower``), client CPU (all nodes,
summed), server CPU (the round's CPU less the nodes' and serialization's), bytes per node (up and
down), and for fedswarm a node's masking cost against serializing its plain update
(``mask_over_serialize``; both are defined, and measured in a fresh interpreter, by
:mod:`fedswarm.bench.secagg_cost`, with the AES-CTR floor of the masks on this machine beside
them; ``FEDSWARM_BENCH_BEFORE=CHECKOUT`` adds the same figures for another checkout's code as
``mask_before``). Targets (issue 44): at n = 100, d = 10^6, fedswarm >= 5x faster than
Flower's SecAgg+ end to end, and a node's masking cost <= 2x serializing its update. The
rounds share one process and, here, two CPU cores with other work: timings are noisy.

Full grid: n = 20, 50, 100 x d = 10^5, 10^6 (long: Flower's arm at n = 100, d = 10^6 takes
minutes); ``--quick``: n = 5, 10 x d = 10^3, 10^4. ``FEDSWARM_SECAGG_GRID=n:d,n:d`` runs a
chosen subset; ``FEDSWARM_SECAGG_ARMS=fedswarm,fedswarm-plain`` leaves Flower's arms out (where
they would not finish: ``speedup_vs_flower`` is then null).

    fedswarm bench secagg [--quick] --out out/
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from fedswarm.bench.arms import quiet_flower, start_bench
from fedswarm.bench.secagg_cost import before_checkout, mask_cost, mask_cost_before_after

__all__ = ["run", "WireGrid", "run_case"]

FULL = [(20, 10**5), (50, 10**5), (100, 10**5), (20, 10**6), (50, 10**6), (100, 10**6)]
QUICK = [(5, 10**3), (10, 10**3), (5, 10**4), (10, 10**4)]
THRESHOLD = 0.6
DROP_FRACTION = 0.05  # of the nodes, lost at the masked-input stage (at least 1 when n >= 10)
CLIP = 1.0
WEIGHT = 10  # every node's num-examples


def _wire_grid_class():
    from flwr.app import Message
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    from fedswarm.sim.inprocess import InProcessGrid

    def roundtrip(content) -> tuple[object, int, float]:
        t0 = time.process_time()
        data = recorddict_to_proto(content).SerializeToString()
        proto = ProtoRecordDict()
        proto.ParseFromString(data)
        out = recorddict_from_proto(proto)
        return out, len(data), time.process_time() - t0

    class WireGrid(InProcessGrid):
        """In-process nodes behind a serializing transport: every message's content crosses as
        bytes each way (counted per node), the nodes' CPU is timed, and ``drop`` nodes lose their
        reply to their ``drop_stage``-th message (0-based) of the round."""

        def __init__(self, client_app, num_nodes: int, *, drop: set[int] = frozenset(), drop_stage: int = 2):
            super().__init__(client_app, num_nodes)
            self.drop, self.drop_stage = set(drop), int(drop_stage)
            self.reset()

        def reset(self) -> None:
            self.client_cpu_s = 0.0
            self.wire_cpu_s = 0.0
            self.bytes_down: dict[int, int] = {}
            self.bytes_up: dict[int, int] = {}
            self.stage_cpu_s: dict[int, float] = {}
            self.calls: dict[int, int] = {}

        def pull_messages(self, message_ids):
            return [r for r in super().pull_messages(message_ids) if r is not None]

        def _execute(self, msg: Message):
            node = int(msg.metadata.dst_node_id)
            k = self.calls.get(node, 0)
            self.calls[node] = k + 1
            content, size, wire = roundtrip(msg.content)
            self.bytes_down[node] = self.bytes_down.get(node, 0) + size
            self.wire_cpu_s += wire
            msg.content = content  # the node gets its own copy, as over a network
            t0 = time.process_time()
            reply = super()._execute(msg)
            spent = time.process_time() - t0
            self.client_cpu_s += spent
            self.stage_cpu_s[k] = self.stage_cpu_s.get(k, 0.0) + spent
            if node in self.drop and k == self.drop_stage:
                return None
            if reply.has_content():
                reply.content, size, wire = roundtrip(reply.content)
                self.bytes_up[node] = self.bytes_up.get(node, 0) + size
                self.wire_cpu_s += wire
            return reply

    return WireGrid


def WireGrid(*args, **kwargs):  # noqa: N802 - a class built on first use (Flower imports are slow)
    return _wire_grid_class()(*args, **kwargs)


def _update(node: int, d: int) -> np.ndarray:
    return np.random.default_rng(node).normal(0.0, 0.1, d).astype(np.float32)


def _fedswarm_app(secure: bool):
    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedswarm.client.secagg_mod import secagg_mod

    app = ClientApp(mods=[secagg_mod] if secure else [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        old = msg.content["arrays"]["w"].numpy()
        new = old + _update(int(context.node_id), old.size)
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(new)}),
                                   "metrics": MetricRecord({"num-examples": WEIGHT})}), reply_to=msg)

    return app


def _fedswarm_round(n: int, d: int, secure: bool, drop: set[int], degree: int, t: int) -> tuple[float, object]:
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from fedswarm.algorithms.secagg import SecAggParams
    from fedswarm.server.secagg import SecAggGrid

    grid = WireGrid(_fedswarm_app(secure), n, drop=drop if secure else set(), drop_stage=2)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 0
    outer = SecAggGrid(grid, SecAggParams(threshold=t, clip=CLIP, bits=32, weight_max=WEIGHT, degree=degree),
                       seed=0) if secure else grid
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    arrays = ArrayRecord({"w": Array(np.zeros(d, dtype=np.float32))})
    t0, c0 = time.perf_counter(), time.process_time()
    result = strategy.start(grid=outer, initial_arrays=arrays, num_rounds=1, timeout=3600)
    wall, grid.round_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    got = result.arrays["w"].numpy()
    return wall, grid, got


def _flower_round(n: int, d: int, secure: bool, drop: set[int], degree: int, t: int) -> tuple[float, object]:
    from flwr.app import Context, RecordDict
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.supercore.task_identity import TaskIdentity

    class Node(NumPyClient):
        def __init__(self, node: int):
            self.node = node

        def fit(self, parameters, config):
            return [parameters[0] + _update(self.node, d)], WEIGHT, {}

    app = ClientApp(client_fn=lambda ctx: Node(int(ctx.node_id)).to_client(),
                    mods=[secaggplus_mod] if secure else [])
    grid = WireGrid(app, n, drop=drop if secure else set(), drop_stage=2)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 0
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n - len(drop) if secure else n,
                      min_available_clients=n, initial_parameters=ndarrays_to_parameters([np.zeros(d, np.float32)]))
    context = LegacyContext(context=Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    fit = SecAggPlusWorkflow(num_shares=degree + 1, reconstruction_threshold=t, clipping_range=CLIP,
                             max_weight=WEIGHT) if secure else None
    workflow = DefaultWorkflow(fit_workflow=fit) if secure else DefaultWorkflow()
    t0, c0 = time.perf_counter(), time.process_time()
    workflow(grid, context)
    wall, grid.round_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common.recorddict_compat import arrayrecord_to_parameters

    got = parameters_to_ndarrays(arrayrecord_to_parameters(context.state.array_records["parameters"], keep_input=True))
    return wall, grid, got[0]


def _row(arm: str, n: int, d: int, wall: float, grid, got: np.ndarray, expect: np.ndarray) -> dict:
    client = grid.client_cpu_s
    return {"arm": arm, "n": n, "d": d, "round_s": round(wall, 4), "round_cpu_s": round(grid.round_cpu_s, 4),
            "client_cpu_s": round(client, 4),
            # the round's process CPU less the nodes' and the transport's: the server's (not wall time,
            # which on a shared machine also counts the time the process waited for a core)
            "server_cpu_s": round(max(grid.round_cpu_s - client - grid.wire_cpu_s, 0.0), 4),
            "wire_cpu_s": round(grid.wire_cpu_s, 4),
            "bytes_up_per_node": int(sum(grid.bytes_up.values()) / n),
            "bytes_down_per_node": int(sum(grid.bytes_down.values()) / n),
            "stage_cpu_s": {str(k): round(v, 4) for k, v in sorted(grid.stage_cpu_s.items())},
            "max_error": float(np.max(np.abs(np.asarray(got, dtype=np.float64) - expect))) if got is not None else None}


def run_case(n: int, d: int) -> list[dict]:
    """The four arms at ``n`` nodes and ``d`` values; rows with ``max_error`` against the true mean."""
    from fedswarm.algorithms.secagg import default_degree, threshold_for

    degree = default_degree(n)
    t = threshold_for(degree + 1, THRESHOLD)
    drop = set(range(1, n + 1)[:max(1 if n >= 10 else 0, int(DROP_FRACTION * n))])
    survivors = [i for i in range(1, n + 1) if i not in drop]
    expect_secure = np.mean([_update(i, d).astype(np.float64) for i in survivors], axis=0)
    expect_plain = np.mean([_update(i, d).astype(np.float64) for i in range(1, n + 1)], axis=0)
    rows = []
    for arm, fn, secure in (("fedswarm-plain", _fedswarm_round, False), ("fedswarm", _fedswarm_round, True),
                            ("flower-plain", _flower_round, False), ("flower", _flower_round, True)):
        if arm not in _arms():
            continue
        wall, grid, got = fn(n, d, secure, drop, degree, t)
        row = _row(arm, n, d, wall, grid, got, expect_secure if secure else expect_plain)
        row.update(degree=degree, threshold=t, dropped=len(drop) if secure else 0)
        rows.append(row)
    plain = {r["arm"]: r for r in rows if not r["dropped"] and r["arm"].endswith("plain")}
    fs = next(r for r in rows if r["arm"] == "fedswarm")
    # A node's masking cost against serializing its plain update: bench/secagg_cost.py defines both
    # and measures them in a fresh interpreter (on FEDSWARM_BENCH_BEFORE's code too, alternately).
    before = before_checkout()
    if before is None:
        fs.update(mask_cost(n, d, weight=WEIGHT))
    else:
        both = mask_cost_before_after(n, d, before, weight=WEIGHT)
        fs.update(both["now"], mask_before=both["before"])
    fl = next((r for r in rows if r["arm"] == "flower"), None)
    fs["speedup_vs_flower"] = None if fl is None else round(fl["round_s"] / fs["round_s"], 2)
    # the same in process CPU seconds (every thread of the round): steadier than wall time on a shared machine
    fs["speedup_vs_flower_cpu"] = None if fl is None else round(fl["round_cpu_s"] / fs["round_cpu_s"], 2)
    fs["overhead_time_x"] = round(fs["round_s"] / plain["fedswarm-plain"]["round_s"], 2)
    fs["overhead_bytes_x"] = round((fs["bytes_up_per_node"] + fs["bytes_down_per_node"])
                                   / max(plain["fedswarm-plain"]["bytes_up_per_node"]
                                         + plain["fedswarm-plain"]["bytes_down_per_node"], 1), 3)
    return rows


ARMS = ("fedswarm-plain", "fedswarm", "flower-plain", "flower")


def _arms() -> tuple[str, ...]:
    env = os.environ.get("FEDSWARM_SECAGG_ARMS")
    if not env:
        return ARMS
    arms = tuple(a.strip() for a in env.split(","))
    if not {"fedswarm", "fedswarm-plain"} <= set(arms) or not set(arms) <= set(ARMS):
        raise SystemExit(f"FEDSWARM_SECAGG_ARMS must name fedswarm and fedswarm-plain and only {', '.join(ARMS)}; "
                         f"got {env!r}")
    return arms


def _grid(quick: bool) -> list[tuple[int, int]]:
    env = os.environ.get("FEDSWARM_SECAGG_GRID")
    if env:
        try:
            return [(int(a), int(float(b))) for a, b in (p.split(":") for p in env.split(","))]
        except ValueError:
            raise SystemExit(f"FEDSWARM_SECAGG_GRID must be 'n:d,n:d' (e.g. 20:1e5,100:1e6), got {env!r}") from None
    return QUICK if quick else FULL


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    quiet_flower()
    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    out_dir = start_bench(out_dir)
    console = Console(width=None if sys.stdout.isatty() else 180)
    rows: list[dict] = []
    for n, d in _grid(quick):
        case = run_case(n, d)
        rows.extend(case)
        fs = next(r for r in case if r["arm"] == "fedswarm")
        console.print(f"  n={n} d={d:g}: fedswarm {fs['round_s']:.2f} s ({fs['speedup_vs_flower']}x Flower's "
                      f"SecAgg+), masking {fs['mask_over_serialize']}x serializing")
    t = Table(title="secagg: one FedAvg round, fedswarm's SecAgg+ (Message API) beside Flower's SecAgg+ (legacy), "
                    "same n, d, threshold, dropouts; one process, timings on a shared machine")
    for col in ("n", "d", "arm", "round s", "client CPU s", "server CPU s", "up B/node", "down B/node",
                "max err", "vs flower", "mask/serialize"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["n"]), f"{r['d']:g}", r["arm"], f"{r['round_s']:.3f}", f"{r['client_cpu_s']:.3f}",
                  f"{r['server_cpu_s']:.3f}", f"{r['bytes_up_per_node']:,}", f"{r['bytes_down_per_node']:,}",
                  f"{r['max_error']:.1e}", f"{r.get('speedup_vs_flower') or ''}", f"{r.get('mask_over_serialize', '')}")
    console.print(t)
    meta = {"threshold": THRESHOLD, "drop_fraction": DROP_FRACTION, "clip": CLIP, "weight": WEIGHT, "quick": quick,
            "grid": _grid(quick), "targets": {"speedup_vs_flower_at_100_1e6": 5.0, "mask_over_serialize": 2.0}}
    (out_dir / "secagg.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, out_dir / "secagg.png")
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, style in (("fedswarm", "o-"), ("flower", "s--"), ("fedswarm-plain", "o:"), ("flower-plain", "s:")):
        for d in sorted({r["d"] for r in rows}):
            pts = sorted((r["n"], r["round_s"], r["bytes_up_per_node"])
                         for r in rows if r["arm"] == arm and r["d"] == d)
            if pts:
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{arm} d={d:g}")
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], style, label=f"{arm} d={d:g}")
    axes[0].set(xlabel="nodes n", ylabel="round wall time (s)", yscale="log", title="one secure FedAvg round")
    axes[1].set(xlabel="nodes n", ylabel="bytes up per node", yscale="log", title="upload per node")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
