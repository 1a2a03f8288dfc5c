"""``fedswarm bench footprint``: the memory sampler measures what a process holds, a node's
failure or hang explains itself, a failed run is no measurement, and the cached venv is keyed by
everything that is installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fedswarm.bench import footprint as fp
from fedswarm.bench import footprint_memory as fm

HOG = textwrap.dedent("""\
    import sys
    block = bytearray({mb} * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    del block  # back to the OS (one mmap): the resident set falls, its high-water mark stays
    print("ready", flush=True)
    sys.stdin.read()
""")


def _hog(tmp_path: Path, name: str, mb: int, new_session: bool) -> subprocess.Popen:
    script = tmp_path / name
    script.write_text(HOG.format(mb=mb))
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         start_new_session=new_session)
    assert p.stdout.readline() == "ready\n"
    return p


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.stdin.close()
        p.wait(timeout=30)


def test_sampler_reports_the_peak_of_each_program_in_the_group(tmp_path):
    """A ClientApp-named process that held 150 MB is seen at 150 MB plus an interpreter though it
    holds far less when sampled (VmHWM, not VmRSS); a process of another group that held more
    (named like a SuperNode) is not counted at all."""
    inside = _hog(tmp_path, "flwr-clientapp", 150, new_session=True)
    outside = _hog(tmp_path, "flower-supernode", 300, new_session=True)
    try:
        with fm.PeakSampler(inside.pid) as sampler:
            deadline = time.monotonic() + 30
            seen = threading.Event()
            while time.monotonic() < deadline and not sampler.peaks.get("flwr-clientapp", 0) >= 150:
                seen.wait(0.05)
    finally:
        _stop(inside, outside)
    peak = sampler.peaks["flwr-clientapp"]
    assert 150 <= peak < 150 + 100, sampler.peaks
    assert sampler.peaks[fm.TOTAL] < 100  # the node's total is what it holds at once: the block is gone
    assert "flower-supernode" not in sampler.peaks


def test_a_node_process_that_exits_is_an_error_with_its_log(tmp_path):
    log = tmp_path / "supernode.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-c", "print('refused: bad flag'); raise SystemExit(3)"], stdout=out)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)the supernode exited with code 3 while waiting for the run"
                                               r".*refused: bad flag"):
            fm._wait(lambda: False, 120, "the run", {"supernode": p}, lambda: log.read_text())
    finally:
        p.wait(timeout=30)


def test_a_timeout_is_an_error_with_the_logs():
    with pytest.raises(RuntimeError, match=r"(?s)timed out after 0 s waiting for the SuperLink\nTAIL"):
        fm._wait(lambda: False, 0.0, "the SuperLink", {}, lambda: "TAIL")


def test_log_tails_name_each_log_and_leave_out_the_bench_polls(tmp_path):
    (tmp_path / "superlink.log").write_text("".join(f"line {i}\nINFO: ControlServicer.ListRuns\n" for i in range(40)))
    text = fm._tails({"superlink": tmp_path / "superlink.log", "serverapp": tmp_path / "none.log"}, lines=3)
    assert text == (f"--- superlink ({tmp_path / 'superlink.log'}), last 3 lines:\nline 37\nline 38\nline 39\n"
                    f"--- serverapp ({tmp_path / 'none.log'}), last 1 lines:\n(no log)")


@pytest.mark.parametrize(("status", "finished"), [(["running"], False), ([], False),
                                                  (["finished:completed"], True)])
def test_run_finished_only_when_completed(monkeypatch, status, finished):
    monkeypatch.setattr(fm, "subprocess", _FakeLs(status))
    assert fm._run_finished({}) is finished


@pytest.mark.parametrize("status", ["finished:failed", "finished:stopped"])
def test_a_failed_run_is_no_measurement(monkeypatch, status):
    monkeypatch.setattr(fm, "subprocess", _FakeLs([status]))
    with pytest.raises(RuntimeError, match=f"the run ended {status}"):
        fm._run_finished({})


class _FakeLs:
    """``subprocess`` whose ``run`` answers like ``flwr ls --format json`` with these statuses."""

    def __init__(self, status: list[str]):
        self.status = status

    def run(self, cmd, **_kw):
        assert cmd[1:3] == ["ls", "local"]
        runs = [{"run-id": str(i), "status": s} for i, s in enumerate(self.status)]
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"runs": runs}), stderr="")


def test_cache_key_follows_installed_code_not_bench_results(monkeypatch, tmp_path):
    for rel, text in {"requirements/lock.txt": "flwr==1\n", "requirements/torch.txt": "torch==2\n",
                      "pyproject.toml": "[project]\n", "client/app.py": "x = 1\n",
                      "bench/footprint.py": "y = 1\n", "bench/footprint.json": "[]\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(fp, "REPO", tmp_path)
    assert fp._cache_key() is None  # not a git checkout: no cache
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    key = fp._cache_key()
    assert key is not None
    (tmp_path / "bench" / "footprint.json").write_text('[{"row": 1}]\n')
    assert fp._cache_key() == key
    for rel in ("client/app.py", "requirements/lock.txt", "bench/footprint.py"):
        before = (tmp_path / rel).read_text()
        (tmp_path / rel).write_text(before + "# changed\n")
        assert fp._cache_key() != key, rel
        (tmp_path / rel).write_text(before)
    assert fp._cache_key() == key


@pytest.mark.integration
@pytest.mark.slow
def test_bare_app_run_finishes_on_one_supernode(tmp_path):
    """The bare Flower App under one real SuperNode (this interpreter's venv) completes its rounds
    (FedAvg's defaults wait for two nodes: the full bench used to time out here)."""
    import torch

    from fedswarm.tasks import get_task

    data, _n = fm._make_data(tmp_path)
    torch.jit.trace(get_task("digits-cnn4").model(0), torch.zeros(2, 1, 8, 8)).save(str(tmp_path / "model.pt"))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "bareapp.py").write_text(fm.BARE_CLIENT)
    (bare / "pyproject.toml").write_text(fm.BARE_PYPROJECT)
    row = fm._one_node("bare Flower ClientApp", Path(sys.executable).parents[1], tmp_path / "node", data, 4, bare,
                       tmp_path / "model.pt", rounds=1, run_timeout=300)
    assert set(row["peaks_mb"]) == {"flower-supernode", "flower-superexec", "flwr-clientapp", fm.TOTAL}
    assert row["peaks_mb"]["flwr-clientapp"] > row["peaks_mb"]["flower-superexec"] > 0


def test_grown_venv_is_built_once_per_key_and_replaces_older_ones(monkeypatch, tmp_path):
    """Same key: the cached rows, marked cached, without growing a venv; a new key: grown afresh,
    the older entry gone; a half-built entry (no rows) is grown again."""
    built = []

    def grow(venv: Path) -> list[dict]:
        venv.mkdir(parents=True)
        built.append(venv)
        return [{"benchmark": "install", "install": "x", "site_packages_mb": float(len(built))}]

    monkeypatch.setattr(fp, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(fp, "install_rows", grow)
    monkeypatch.setattr(fp, "_cache_key", lambda: "k1")
    venv, rows = fp._grown_venv(tmp_path / "work")
    assert venv == tmp_path / "cache" / "k1" / "venv" and rows[0]["site_packages_mb"] == 1.0 and "cached" not in rows[0]
    venv, rows = fp._grown_venv(tmp_path / "work")
    assert len(built) == 1 and rows[0]["site_packages_mb"] == 1.0 and rows[0]["cached"].endswith("Z")
    monkeypatch.setattr(fp, "_cache_key", lambda: "k2")
    venv, rows = fp._grown_venv(tmp_path / "work")
    assert len(built) == 2 and rows[0]["site_packages_mb"] == 2.0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k2"]
    (tmp_path / "cache" / "k2" / "install.json").unlink()
    fp._grown_venv(tmp_path / "work")
    assert len(built) == 3
    monkeypatch.setattr(fp, "_cache_key", lambda: None)
    venv, rows = fp._grown_venv(tmp_path / "work")
    assert len(built) == 4 and venv == tmp_path / "work" / "venv"
