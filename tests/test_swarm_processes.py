"""Swarm peers as separate processes on loopback: they converge, they match the in-process
simulation of the same algorithm object, and they survive a killed peer, which resumes
from its checkpoint and rejoins."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from fedswarm.swarm.launcher import SwarmSpec, launch_swarm, peer_address, peer_command
from fedswarm.procs import stop_process_groups

from tests.helpers import wait_until

pytestmark = pytest.mark.integration
ROUNDS = 5


def _oracle_dpsgd(spec: SwarmSpec, ids: list[str]) -> list[torch.Tensor]:
    """The plain [n, d] simulation with gossip.py's DPSGD object: same seeds, same ring
    over the sorted peer ids, no failures. Returns X after each round."""
    from fedswarm.algorithms.decentralized import make_algorithm
    from fedswarm.algorithms.decentralized.topology import make_topology
    from fedswarm.config import round_seed

    from fedswarm.config import RunConfig
    from fedswarm.params import get_flat
    from fedswarm.train import trainer_for

    n = spec.peers
    order = sorted(range(n), key=lambda i: ids[i])  # node k of the ring is peer order[k]
    cfg = RunConfig(task=spec.task, partition=spec.partition, seed=spec.seed, clients=n)
    trainers = [trainer_for(cfg, order[k], n) for k in range(n)]
    x0 = get_flat(trainers[0].task.model(spec.seed))
    algo, topo = make_algorithm("dpsgd"), make_topology("ring", n)
    state = algo.init_state(x0.repeat(n, 1))
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the peers run
    try:
        for r in range(1, spec.rounds + 1):
            grads = torch.stack([
                (state.x[k] - trainers[k].fit(state.x[k], steps=spec.local_steps, batch_size=spec.batch_size,
                                              lr=spec.lr, seed=round_seed(spec.seed, r, order[k])).flat) / spec.lr
                for k in range(n)])
            algo.local_step(state, grads, spec.lr)
            algo.mix(state, algo.message(state), topo.mixing_matrix(r))
            out.append(state.x[torch.argsort(torch.tensor(order))].clone())  # back to peer order
    finally:
        torch.set_num_threads(threads)
    return out


def test_four_peer_processes_converge_and_match_the_simulator(tmp_path):
    from fedswarm.swarm.cli import app
    from typer.testing import CliRunner

    spec = SwarmSpec(peers=4, algorithm="dpsgd", rounds=ROUNDS, out=tmp_path, local_steps=10, lr=0.3)
    res = CliRunner().invoke(app, ["swarm", "--peers", "4", "--algorithm", "dpsgd", "--rounds", str(ROUNDS),
                                   "--out", str(tmp_path), "--local-steps", "10", "--lr", "0.3",
                                   "--round-timeout", "60", "--timeout", "150"])
    assert res.exit_code == 0, res.output
    assert "node-avg acc" in res.output
    result = json.loads((tmp_path / "result.json").read_text())
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert all(r["num_clients"] == 4 for r in rounds)
    assert rounds[-1]["test_accuracy"] > 0.8, rounds  # node-average model; chance is 0.1
    assert rounds[-1]["test_accuracy"] > rounds[0]["test_accuracy"]
    assert all(r["bytes_up"] >= 4 * 2 * 4 * 4810 for r in rounds)  # 4 peers x 2 neighbours x a float32 model
    s = result["summary"]  # what one socket sent another received (but for heartbeats cut off at shutdown)
    assert s["total_bytes_up"] == pytest.approx(s["total_bytes_down"], rel=0.01)
    assert result["summary"]["dropped"] == {}
    assert all(r["consensus_distance"] is not None for r in rounds)
    # the same algorithm object, in-process, gives the same models (fixed schedule, no failures)
    ids = [p["peer_id"] for p in result["peers"]]
    for r, X in enumerate(_oracle_dpsgd(spec, ids), start=1):
        for i in range(spec.peers):
            got = torch.from_numpy(np.load(tmp_path / "peers" / f"p{i}" / "models" / f"r{r:05d}.npy"))
            torch.testing.assert_close(got, X[i], rtol=0, atol=1e-5)


def _round(pdir: Path) -> int:
    try:
        return int((pdir / "round").read_text())
    except (OSError, ValueError):
        return 0


def test_killed_peer_costs_neighbours_an_exchange_and_restarts_from_its_checkpoint(tmp_path):
    from fedswarm.swarm.net.identity import create_or_load

    n, victim = 3, 2
    spec = SwarmSpec(peers=n, algorithm="dpsgd", rounds=500, local_steps=5, task="synthetic-logreg",
                     round_timeout_s=1.0,
                     heartbeat_s=0.2, save_models=False, extra_args=["--min-round-s", "0.25", "--linger", "0"])
    pdirs = [tmp_path / f"p{i}" for i in range(n)]
    ids = [create_or_load(d / "keys").peer_id for d in pdirs]
    allow = tmp_path / "allow.txt"
    allow.write_text("\n".join(ids) + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[int, subprocess.Popen] = {}

    def spawn(i, cmd):
        (pdirs[i] / "address").unlink(missing_ok=True)
        log = open(pdirs[i] / "peer.log", "a")
        procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def running(pred):
        """``pred``, failing at once with the peer's log if a peer process has exited."""
        def check():
            for i, p in procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"peer {i} exited ({p.returncode}):\n{(pdirs[i] / 'peer.log').read_text()}")
            return pred()
        return check

    try:
        # every peer binds port 0 and writes the port it got (no free-port guess another process can take)
        spawn(0, peer_command(spec, 0, 0, None, allow, pdirs[0]))
        join = peer_address(pdirs[0], procs[0], 60)
        for i in range(1, n):
            spawn(i, peer_command(spec, i, 0, join, allow, pdirs[i]))
        wait_until(running(lambda: _round(pdirs[victim]) >= 3), 90, interval=0.1, what="the swarm starting")
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        killed_at = _round(pdirs[victim])
        survivors_at_kill = {i: _round(d) for i, d in enumerate(pdirs) if i != victim}
        # the survivors' failure detector removes it (remove_after heartbeats of silence) before it
        # comes back: waited for in their logs, not left to how long a restart takes
        gone = f"peer {ids[victim][:8]} removed"
        dead = procs.pop(victim)  # its exit is expected now: running() checks the survivors
        wait_until(running(lambda: all(gone in (pdirs[i] / "peer.log").read_text() for i in survivors_at_kill)),
                   60, interval=0.1, what="the survivors removing the killed peer")
        assert dead.poll() is not None
        # restarted on a new port: the survivors learn it from its higher incarnation's gossip
        cmd = peer_command(spec, victim, 0, join, allow, pdirs[victim])
        cmd[cmd.index("--min-peers") + 1] = "1"
        spawn(victim, cmd)
        peer_address(pdirs[victim], procs[victim], 90)
        # the restarted peer resumes, catches up with its neighbours and trains with them again
        wait_until(running(lambda: _round(pdirs[victim]) >= max(_round(d) for d in pdirs) - 1
                           and _round(pdirs[victim]) > killed_at + 4), 90, interval=0.1,
                   what="the restarted peer rejoining")
        rejoined_at = _round(pdirs[victim])
        # two more whole rounds in step with its neighbours: exchanges after the restart
        wait_until(running(lambda: _round(pdirs[victim]) >= rejoined_at + 2), 60, interval=0.1,
                   what="the restarted peer training on")
    finally:
        stop_process_groups(list(procs.values()), grace_s=20)
    res = [json.loads((d / "result.json").read_text()) for d in pdirs]
    # survivors carried on: they trained past the kill, with fewer answers while it was dead
    for i, r in enumerate(res):
        if i == victim:
            continue
        assert r["rounds_done"] > survivors_at_kill[i] + 3
        assert any(e[1] == "removed" and e[2] == ids[victim][:8] for e in r["events"]), r["events"]
    short = [row for i, r in enumerate(res) if i != victim for row in r["rows"]
             if row.get("answered", 0) < row.get("neighbours", 0)]
    assert short, "no survivor ever missed the dead peer"
    # the restarted peer continued from its checkpoint, not from round 1, and exchanged again
    rows = res[victim]["rows"]
    before = [row for row in rows if row["restarts"] == 0]
    after = [row for row in rows if row["restarts"] == 1]
    assert res[victim]["restarts"] == 1 and before and after
    assert before[-1]["round"] in (killed_at, killed_at + 1)
    assert after[0]["round"] > before[-1]["round"]
    assert all(b["round"] > a["round"] for a, b in pairwise(rows))
    assert sum(row["answered"] for row in after) > 0


def test_swarm_with_failures_carries_on(tmp_path):
    spec = SwarmSpec(peers=3, algorithm="swarm_merge", rounds=6, out=tmp_path, fail=(1, 2), round_timeout_s=1.5,
                     task="synthetic-logreg",
                     lr=0.3, timeout_s=150.0, save_models=False)
    result = launch_swarm(spec, log=lambda m: None)
    assert result["summary"]["killed"] == [2]
    survivors = [p for p in result["peers"] if not p["killed"]]
    assert len(survivors) == 2 and all(p["rounds_done"] == 6 for p in survivors)
    assert result["rounds"][-1]["num_clients"] == 2
    assert result["rounds"][-1]["test_accuracy"] > 0.7  # mean of the survivors' (merged, equal) models


def test_swarm_command_rejects_bad_arguments(tmp_path):
    from fedswarm.swarm.cli import app
    from typer.testing import CliRunner

    for args in (["--fail", "2"], ["--fail", "4@2"], ["--algorithm", "nope"]):
        res = CliRunner().invoke(app, ["swarm", "--peers", "4", "--out", str(tmp_path), *args])
        assert res.exit_code == 2, (args, res.output)


def test_peer_command_names_a_bad_value_in_one_line(tmp_path):
    from fedswarm.swarm.cli import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["peer", "--lr", "0", "--state-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "invalid value for 'lr'" in res.output and "Traceback" not in res.output


def test_peer_that_dies_before_listening_is_reported_with_its_log(tmp_path):
    spec = SwarmSpec(peers=2, rounds=1, lr=0.1)
    pdir = tmp_path / "p0"
    pdir.mkdir()
    cmd = peer_command(spec, 0, 0, None, tmp_path / "missing-allow.txt", pdir)
    with open(pdir / "peer.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)peer p0 exited with code [12] before it listened:.*allow"):
            peer_address(pdir, proc, 60)
    finally:
        proc.kill()
        proc.wait()
    assert not (pdir / "address").exists()
