"""A task for the crash tests: ``digits-mlp`` whose local training can be told to stop dead.

``--task tests.resume_helpers:make_task`` is digits-mlp exactly (same model, data and
objective), so a run with it matches a digits-mlp run. With ``FEDSWARM_TEST_HOLD=N:DIR`` in
the environment, training steps are counted in ``DIR/steps`` across every process that has
it (a simulation, or all the ClientApp processes of a deployment, one per message), and from
step N+1 on a step writes ``DIR/held-<pid>`` and waits until ``DIR/release`` exists: the test
then knows, without sleeping, that the run is in the middle of a round (N = the steps of the
rounds before it), and kills what it wants there with SIGKILL.

``tests.resume_helpers:make_logreg_task`` is ``synthetic-logreg`` with a per-process gate for
the swarm fault test: with ``FEDSWARM_TEST_GATE=N:DIR``, each process counts its own training
steps, and from step N+1 on waits until ``DIR/release`` exists (writing ``DIR/gated-<pid>``):
the swarm's survivors stop at a known round until the test has seen the killed peers come
back, whatever the machine's load makes their restart cost.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
from pathlib import Path

import torch

from fedswarm.tasks import TASKS, Task

HOLD_ENV = "FEDSWARM_TEST_HOLD"
GATE_ENV = "FEDSWARM_TEST_GATE"
_own_steps = [0]  # this process's training steps (the gate counts per process)


def _count(path: Path) -> int:
    """Add one to the counter in ``path`` under an exclusive lock; the new count."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0) + 1
        f.seek(0)
        f.truncate()
        f.write(str(n))
        f.flush()
        return n


def _held_objective(base):
    def objective(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        spec = os.environ.get(HOLD_ENV)
        if spec and model.training and torch.is_grad_enabled():
            limit, _, folder = spec.partition(":")
            step = _count(Path(folder, "steps"))
            if step > int(limit):
                Path(folder, f"held-{os.getpid()}").write_text(str(step))
                release, pause = Path(folder, "release"), threading.Event()
                for _ in range(20 * 600):  # 10 minutes at most; the test kills or releases long before
                    if release.exists():
                        break
                    pause.wait(0.05)
        return base(model, x, y)

    return objective


def _wait_for(release: Path, marker: Path) -> None:
    marker.write_text("")
    pause = threading.Event()
    for _ in range(20 * 600):  # 10 minutes at most; the test releases long before
        if release.exists():
            return
        pause.wait(0.05)


def _gated_objective(base):
    def objective(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        spec = os.environ.get(GATE_ENV)
        if spec and model.training and torch.is_grad_enabled():
            limit, _, folder = spec.partition(":")
            _own_steps[0] += 1
            if _own_steps[0] > int(limit) and not Path(folder, "release").exists():
                _wait_for(Path(folder, "release"), Path(folder, f"gated-{os.getpid()}"))
        return base(model, x, y)

    return objective


def make_logreg_task() -> Task:
    base = TASKS["synthetic-logreg"]
    return dataclasses.replace(base, objective=_gated_objective(base.objective))


def make_task() -> Task:
    base = TASKS["digits-mlp"]
    return dataclasses.replace(base, objective=_held_objective(base.objective))
