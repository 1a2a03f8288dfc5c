"""One arm of a benchmark: a run config recorded in a store and run on its engine through
:func:`fedswarm.sim.engines.run_engine`, the dispatch ``fedswarm run`` uses (so a bench arm runs
exactly as the command line would run its config: the engine :func:`~fedswarm.sim.engines.engine_for`
picks, its config check, its threads), then checked and exported.

    with scratch_store() as store:
        arm = run_arm(cfg, store, name="bench-x fedavg")
        arm.summary["final_test_accuracy"], arm.trained_rounds, arm.wall_s
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from fedswarm.config import RunConfig
from fedswarm.server.recorder import RoundListener
from fedswarm.sim.engines import run_engine
from fedswarm.store import Store

__all__ = ["Arm", "run_arm", "scratch_store", "bytes_up_curve", "quiet_flower", "start_bench"]


@dataclass(frozen=True)
class Arm:
    """A finished arm: its run id and final status, :meth:`Store.export_result` of the run, and
    the seconds :func:`run_engine` took (the engine's set-up included)."""

    run_id: str
    status: str
    result: dict
    wall_s: float

    @property
    def rounds(self) -> list[dict]:
        """Every recorded round, round 0 (the initial model) included."""
        return self.result["rounds"]

    @property
    def trained_rounds(self) -> list[dict]:
        """The rounds after round 0."""
        return [r for r in self.rounds if r["round"] > 0]

    @property
    def summary(self) -> dict:
        return self.result["summary"]


def run_arm(cfg: RunConfig, store: Store, *, name: str | None = None, run_id: str | None = None,
            listeners: list[RoundListener] | None = None, ok: Sequence[str] | None = ("finished",)) -> Arm:
    """Run ``cfg`` on its engine, recorded in ``store`` (in ``run_id``, or a new run called ``name``);
    raise :class:`RuntimeError` naming the arm, its status and the run's error unless it ends in a
    status of ``ok`` (``("finished", "stopped")`` for an arm a listener stops; None: any status, for
    a caller that reports it)."""
    run_id = run_id or store.create_run(cfg.model_dump(), name=name)
    t0 = time.perf_counter()
    status = run_engine(cfg, store=store, run_id=run_id, listeners=listeners)
    wall_s = time.perf_counter() - t0
    if ok is not None and status not in ok:
        error = store.get_run(run_id).error
        raise RuntimeError(f"arm '{name or cfg.strategy}' ended {status}" + (f": {error}" if error else ""))
    return Arm(run_id, status, store.export_result(run_id), wall_s)


@contextmanager
def scratch_store(name: str = "bench.db") -> Iterator[Store]:
    """A store in a temporary folder, closed and removed after the block."""
    with tempfile.TemporaryDirectory(prefix="fedswarm-bench-") as tmp:
        store = Store(Path(tmp) / name)
        try:
            yield store
        finally:
            store.close()


def bytes_up_curve(rounds: list[dict]) -> list[list]:
    """``[cumulative bytes up, test accuracy]`` after each of ``rounds``."""
    up, curve = 0, []
    for r in rounds:
        up += r["bytes_up"] or 0
        curve.append([up, r["test_accuracy"]])
    return curve


def quiet_flower() -> None:
    """Only Flower's errors on the console: a bench's output is its table, not Flower's round log.
    (Importing flwr sets its logger's level: it is imported first.)"""
    import flwr  # noqa: F401

    logging.getLogger("flwr").setLevel(logging.ERROR)


def start_bench(out_dir: str | Path) -> Path:
    """What a benchmark of small models does first: torch on one thread (per-client work is small:
    more threads only add overhead), and its output folder made; returns the folder."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out
