"""fedswarm's console is its own: the README's first command (``fedswarm sim --out out``) shows
fedswarm's progress bar, messages and summary; Flower's and Ray's log goes to ``OUT/flower.log``
and reaches the console only with ``--verbose``; fedswarm's warnings reach it in its words."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from fedswarm.cli.common import log_file_for, route_logs

# A line of Flower's console format ("INFO :      ..." with or without colour codes) or Ray's
# ("2026-01-01 00:00:00,000\tINFO worker.py:1 -- ...").
LIBRARY_LINE = re.compile(r"^(\x1b\[\d+m)?(DEBUG|INFO|WARNING|ERROR|CRITICAL) *(\x1b\[0m)? *:"
                          r"|\t(DEBUG|INFO|WARNING|ERROR) \S+\.py:\d+ --", re.M)
TINY = ["--task", "synthetic-logreg", "--clients", "2", "--rounds", "1", "--local-steps", "1"]


def _sim(tmp_path, *extra: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """The README's first command on a tiny config, in a fresh interpreter: Flower and Ray set
    their loggers up when first imported, which an in-process run would have done long before.
    Its own session, so that nothing it started (Ray's processes) outlives the test."""
    cmd = [sys.executable, "-m", "fedswarm", "sim", "--out", str(tmp_path / "out"), "--db", str(tmp_path / "s.db"),
           *TINY, *extra]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout + stderr
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_readme_command_prints_no_flower_log_line_and_writes_it_to_the_log_file(tmp_path):
    proc = _sim(tmp_path)
    console = proc.stdout + proc.stderr
    assert not LIBRARY_LINE.search(console), console
    assert "fraction_evaluate" not in console and "partition-id" not in console
    assert "rounds 1/1" in proc.stdout and "final test accuracy" in proc.stdout  # fedswarm's bar and summary
    log = (tmp_path / "out" / "flower.log").read_text()
    assert "[ROUND 1/1]" in log and " INFO flwr: " in log
    assert f"Flower's log: {tmp_path / 'out' / 'flower.log'}" in proc.stdout


def test_verbose_shows_flowers_log_on_the_console(tmp_path):
    proc = _sim(tmp_path, "--verbose")
    flower_lines = LIBRARY_LINE.findall(proc.stdout + proc.stderr)
    assert len(flower_lines) >= 10 and "[ROUND 1/1]" in proc.stderr
    assert "[ROUND 1/1]" in (tmp_path / "out" / "flower.log").read_text()  # the log file has it either way


@pytest.mark.integration
@pytest.mark.slow
def test_flowers_engine_on_ray_prints_no_library_line_either(tmp_path):
    """Ray sets its own console log up when imported, and ``ray.init`` reformats its handlers."""
    proc = _sim(tmp_path, "--engine", "flower", timeout_s=800)
    console = proc.stdout + proc.stderr
    assert not LIBRARY_LINE.search(console), console
    log = (tmp_path / "out" / "flower.log").read_text()
    assert " INFO ray." in log and "Started a local Ray instance" in log  # Ray's log, in the file's one format
    assert all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ [\w.]+: ", line) for line in log.splitlines()
               if line[:1].isdigit())


def test_fedswarms_warnings_reach_the_console_in_its_words_and_flowers_only_the_file(tmp_path, capfd):
    from flwr.common.logger import FLOWER_LOGGER, console_handler

    level = console_handler.level
    stream = console_handler.setStream(sys.stderr)  # the stream capfd captures, not the one at Flower's import
    path = log_file_for(tmp_path)
    undo = route_logs(False, path)
    try:
        FLOWER_LOGGER.info("[ROUND 1/1] from Flower")
        logging.getLogger("fedswarm.server").warning("run r1: round 2: 1 of 3 nodes failed (no reply)")
        logging.getLogger("fedswarm.server").info("for the file only")
    finally:
        undo()
        console_handler.setStream(stream)
    captured = capfd.readouterr()
    console = captured.out + captured.err
    assert "warning: run r1: round 2: 1 of 3 nodes failed (no reply)" in console
    assert "from Flower" not in console and "for the file only" not in console
    log = path.read_text()
    assert "INFO flwr: [ROUND 1/1] from Flower" in log and "for the file only" in log and "nodes failed" in log
    assert console_handler.level == level and console_handler in FLOWER_LOGGER.handlers  # undone


def test_log_file_without_out_is_under_the_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    path = log_file_for(None)
    assert path.parent == tmp_path / "fedswarm" / "logs" and path.suffix == ".log"
    assert log_file_for(tmp_path / "o") == tmp_path / "o" / "flower.log"
