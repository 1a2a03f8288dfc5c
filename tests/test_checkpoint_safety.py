"""Checkpoints cannot run code, and the checkpoints earlier releases wrote still resume.

- a store written by fedswarm 0.1.0 (tests/fixtures/store-v1-checkpoints.sqlite3, made by
  tests/fixtures/make_store_v1.py before checkpoints were read with an allowlist): each run's
  checkpoint reads as the unrestricted unpickler reads it, and the run resumes to its end;
- a checkpoint whose pickle calls ``os.system`` (through ``__reduce__``) put into a real store:
  ``fedswarm resume`` refuses it in one line naming the callable, and the command never ran;
- the same file as a swarm peer's checkpoint is refused, and runs nothing.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedswarm.errors import CheckpointError
from fedswarm.server.checkpoint import load_latest, loads
from fedswarm.server.resume import prepare_resume
from fedswarm.sim.run import run_engine
from fedswarm.store import Store
from fedswarm.swarm import checkpoint as peer_checkpoint
from tests.test_resume import _same

ROOT = Path(__file__).resolve().parents[1]
V1_STORE = Path(__file__).parent / "fixtures" / "store-v1-checkpoints.sqlite3"


class _RunsCommand:
    """Pickles as a call of ``os.system(command)``: what a hostile checkpoint would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _hostile_checkpoint(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": 1, "round": 2, "payload": _RunsCommand(f"touch {marker}")}, buf)
    return buf.getvalue()


@pytest.fixture
def v1_store(tmp_path) -> Store:
    path = tmp_path / "store.db"
    shutil.copyfile(V1_STORE, path)
    return Store(path)


def test_the_hostile_payload_runs_code_when_unpickled_unrestricted(tmp_path):
    """The oracle for the tests below: unpickled without the allowlist, the file runs its command."""
    marker = tmp_path / "ran"
    torch.load(io.BytesIO(_hostile_checkpoint(marker)), weights_only=False)
    assert marker.exists()


def test_a_previous_release_store_resumes_every_run(v1_store):
    runs = v1_store.list_runs()
    assert len(runs) == 7 and all(r.status == "failed" for r in runs)
    for run in runs:
        found = v1_store.checkpoint_data(run.id)
        assert found is not None, run.name
        ck = loads(found[1])
        unrestricted = torch.load(io.BytesIO(found[1]), weights_only=False)  # the fixture is ours: trusted here
        _same(ck.strategy, unrestricted["strategy"], f"{run.name}.strategy")
        _same(ck.rng, unrestricted["rng"], f"{run.name}.rng")
        _same(ck.grid, unrestricted["grid"], f"{run.name}.grid")
        _same(ck.byzantine, unrestricted["byzantine"], f"{run.name}.byzantine")
        cfg, resumed = prepare_resume(v1_store, run.id)
        assert resumed.round == (1 if cfg.strategy == "hl" else 2), run.name
        assert run_engine(cfg, store=v1_store, run_id=run.id, resume=resumed) == "finished", run.name
        assert [r.round for r in v1_store.rounds(run.id)] == [0, 1, 2, 3], run.name
        assert load_latest(v1_store, run.id).round == 3


def test_resume_refuses_a_checkpoint_that_would_run_code(v1_store, tmp_path):
    run = next(r for r in v1_store.list_runs() if r.name == "v1-fedavg-dp")
    marker = tmp_path / "ran"
    v1_store.save_checkpoint(run.id, 2, _hostile_checkpoint(marker), keep=2)
    with pytest.raises(CheckpointError, match=r"names posix\.system, which no fedswarm checkpoint holds"):
        prepare_resume(v1_store, run.id)
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLWR_HOME=str(tmp_path / "flwr"))
    done = subprocess.run([sys.executable, "-m", "fedswarm", "resume", run.id, "--db", v1_store.url],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: the checkpoint names posix.system"), lines
    assert "refused without running it" in lines[0]
    assert not marker.exists(), "the checkpoint's command ran"
    assert v1_store.get_run(run.id).status == "failed"  # nothing was started either


def test_a_peer_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / peer_checkpoint.CHECKPOINT_FILE).write_bytes(_hostile_checkpoint(marker))
    with pytest.raises(peer_checkpoint.CheckpointError, match="cannot be read"):
        peer_checkpoint.load_checkpoint(tmp_path)
    assert not marker.exists()
