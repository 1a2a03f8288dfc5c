"""``fedswarm swarm``: start N peer processes on loopback, optionally kill some mid-run,
collect what each did and write ``result.json`` (docs/architecture.md, "Output contract").

The launcher creates every peer's key pair and one allow list, so even a demo swarm
refuses keys it does not know. Peers are ``sys.executable -m fedswarm.swarm.cli peer``
processes in their own session; every one is stopped before :func:`launch_swarm`
returns. Accuracy per round is that of the node-average model (peers save their model
every round), with ``consensus_distance`` = mean squared distance to that average.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from pydantic import Field

from fedswarm.config import LearningRate, LocalSteps, TrainingSpec
from fedswarm.procs import stop_process_groups

__all__ = ["SwarmSpec", "aggregate", "launch_swarm", "parse_fail", "peer_address", "peer_command"]


def parse_fail(text: str | None) -> tuple[int, int] | None:
    """``K@R`` -> (K, R): kill K peers when the swarm reaches round R."""
    if not text:
        return None
    k, sep, r = text.partition("@")
    if not sep or not k.isdigit() or not r.isdigit() or int(k) < 1 or int(r) < 1:
        raise ValueError(f"--fail must be K@R with integers K, R >= 1 (got {text!r})")
    return int(k), int(r)


class SwarmSpec(TrainingSpec):
    """A whole local swarm: its peers' shared training fields (fedswarm's
    :class:`~fedswarm.config.TrainingSpec`, with a swarm's defaults) and how to start them."""

    local_steps: LocalSteps = 10
    lr: LearningRate = 0.1
    peers: int = 4
    algorithm: str = "dpsgd"
    out: Path = Path("swarm-out")
    fail: tuple[int, int] | None = None
    restart_after_s: float | None = None
    base_port: int = 0  # 0: pick free ports
    round_timeout_s: float = 10.0
    heartbeat_s: float = 0.3
    timeout_s: float = 600.0
    save_models: bool = True
    extra_args: list[str] = Field(default_factory=list)


def peer_command(spec: SwarmSpec, i: int, port: int, join: str | None, allow: Path, pdir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "fedswarm.swarm.cli", "peer", "--listen", f"127.0.0.1:{port}",
           "--algorithm", spec.algorithm, "--task", spec.task, "--partition", spec.partition,
           "--partition-id", str(i), "--num-partitions", str(spec.peers), "--rounds", str(spec.rounds),
           "--seed", str(spec.seed), "--local-steps", str(spec.local_steps), "--lr", str(spec.lr),
           "--batch-size", str(spec.batch_size), "--topology", spec.topology, "--keys", str(pdir / "keys"),
           "--allow", str(allow), "--state-dir", str(pdir), "--min-peers", str(spec.peers),
           "--round-timeout", str(spec.round_timeout_s), "--heartbeat", str(spec.heartbeat_s)]
    if join:
        cmd += ["--join", join]
    for k, v in spec.params.items():
        cmd += ["--set", f"{k}={v}"]
    if spec.save_models:
        cmd.append("--save-models")
    return cmd + list(spec.extra_args)


def peer_address(pdir: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    """The HOST:PORT the peer started as ``proc`` with state dir ``pdir`` bound (it writes
    ``pdir/address``; remove a stale one before starting it). Raises RuntimeError, with the
    tail of its log, if it exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    path = pdir / "address"
    while True:
        if path.exists():
            return path.read_text().strip()
        if proc.poll() is not None or time.monotonic() > deadline:
            log = pdir / "peer.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
            what = f"exited with code {proc.returncode}" if proc.returncode is not None \
                else f"did not bind within {timeout_s:.0f} s"
            raise RuntimeError(f"peer {pdir.name} {what} before it listened:\n{tail}")
        time.sleep(0.02)


def _progress(pdir: Path) -> int:
    try:
        return int((pdir / "round").read_text())
    except (OSError, ValueError):
        return 0


def launch_swarm(spec: SwarmSpec, *, log=print) -> dict:
    from fedswarm.swarm.net.identity import create_or_load

    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    pdirs = [out / "peers" / f"p{i}" for i in range(spec.peers)]
    ids = [create_or_load(d / "keys").peer_id for d in pdirs]
    allow = out / "allow.txt"
    allow.write_text("# peers of this swarm\n" + "\n".join(ids) + "\n")
    # base_port 0: every peer binds port 0 and writes the port it got; peer 0's is the join address
    ports = [spec.base_port + i if spec.base_port else 0 for i in range(spec.peers)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[int, subprocess.Popen] = {}
    logs = []
    killed: list[int] = []
    restarted: list[int] = []

    def spawn(i: int, cmd: list[str]) -> None:
        (pdirs[i] / "address").unlink(missing_ok=True)
        f = open(pdirs[i] / "peer.log", "a")
        logs.append(f)
        procs[i] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    t0 = time.time()
    try:
        deadline = time.monotonic() + spec.timeout_s
        spawn(0, peer_command(spec, 0, ports[0], None, allow, pdirs[0]))
        addrs = {0: peer_address(pdirs[0], procs[0], spec.timeout_s)}
        for i in range(1, spec.peers):
            spawn(i, peer_command(spec, i, ports[i], addrs[0], allow, pdirs[i]))
        kill_at = None
        while time.monotonic() < deadline:
            if all(p.poll() is not None for p in procs.values()):
                break
            if spec.fail and not killed and max(_progress(d) for d in pdirs) >= spec.fail[1]:
                for i in range(spec.peers - spec.fail[0], spec.peers):  # never the join peer
                    os.killpg(procs[i].pid, signal.SIGKILL)
                    procs[i].wait()
                    killed.append(i)
                kill_at = time.monotonic()
                log(f"killed peers {killed} at round {spec.fail[1]}")
            if killed and not restarted and spec.restart_after_s is not None \
                    and time.monotonic() - kill_at >= spec.restart_after_s:
                for i in killed:
                    live = next(j for j in range(spec.peers) if j not in killed)
                    live_addr = addrs.get(live) or peer_address(pdirs[live], procs[live], 5.0)
                    cmd = peer_command(spec, i, ports[i], live_addr, allow, pdirs[i])
                    cmd[cmd.index("--min-peers") + 1] = "1"
                    spawn(i, cmd)
                    restarted.append(i)
                log(f"restarted peers {restarted}")
            time.sleep(0.05)
        else:
            log(f"swarm did not finish within {spec.timeout_s:.0f} s; stopping it")
    finally:
        stop_process_groups(list(procs.values()), grace_s=10)
        for f in logs:
            f.close()
    result = aggregate(spec, pdirs, ids, killed=killed, restarted=restarted, wall_s=time.time() - t0)
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _peer_record(pdir: Path) -> dict:
    path = pdir / "result.json"
    if path.exists():
        return json.loads(path.read_text())
    from fedswarm.swarm.checkpoint import load_checkpoint

    ck = load_checkpoint(pdir)  # killed and not restarted: its rows survive in the checkpoint
    return {"rows": list(ck["history"]) if ck else [], "bytes_up": None, "bytes_down": None, "dropped": {},
            "killed": True}


def aggregate(spec: SwarmSpec, pdirs: list[Path], ids: list[str], *, killed=(), restarted=(), wall_s=0.0) -> dict:
    """Per-round rows (node-average accuracy, bytes summed over peers, consensus distance)
    and per-peer rows, from the peers' result files, checkpoints and saved models."""
    import numpy as np
    import torch

    from fedswarm.config import RunConfig
    from fedswarm.tasks import get_task
    from fedswarm.train import evaluate_flat, task_data

    records = [_peer_record(d) for d in pdirs]
    cfg = RunConfig(task=spec.task, seed=spec.seed, partition=spec.partition, clients=spec.peers)
    task, data = get_task(spec.task), task_data(cfg)
    model = task.model(spec.seed)
    rounds = []
    for r in range(1, spec.rounds + 1):
        rows = [(i, row) for i, rec in enumerate(records) for row in rec["rows"] if row["round"] == r]
        if not rows:
            continue
        models = [np.load(f) for i, _ in rows if (f := pdirs[i] / "models" / f"r{r:05d}.npy").exists()]
        entry: dict[str, Any] = {"round": r, "num_clients": len(rows),
                                 "bytes_up": sum(int(x.get("bytes_up", 0)) for _, x in rows),
                                 "bytes_down": sum(int(x.get("bytes_down", 0)) for _, x in rows),
                                 "wall_s": max(float(x.get("wall_s", 0.0)) for _, x in rows), "sim_time_s": None}
        losses = [x["train_loss"] for _, x in rows if x.get("train_loss") is not None]
        entry["train_loss"] = float(np.mean(losses)) if losses else None
        accs = [x["test_accuracy"] for _, x in rows if x.get("test_accuracy") is not None]
        entry["mean_peer_accuracy"] = float(np.mean(accs)) if accs else None
        if models:
            X = torch.from_numpy(np.stack(models))
            avg = X.mean(dim=0)
            entry["test_loss"], entry["test_accuracy"] = evaluate_flat(task, model, avg, data.test_x, data.test_y,
                                                                       torch.device("cpu"))
            entry["consensus_distance"] = float((X - avg).pow(2).sum(dim=1).mean())
        else:
            entry["test_loss"], entry["consensus_distance"] = None, None
            entry["test_accuracy"] = entry["mean_peer_accuracy"]
        rounds.append(entry)
    peers = []
    for i, rec in enumerate(records):
        last = rec["rows"][-1] if rec["rows"] else {}
        peers.append({"peer": i, "peer_id": ids[i], "partition_id": i, "rounds_done": last.get("round", 0),
                      "final_accuracy": last.get("test_accuracy"), "bytes_up": rec.get("bytes_up"),
                      "bytes_down": rec.get("bytes_down"), "dropped": rec.get("dropped", {}),
                      "killed": i in killed and i not in restarted, "restarted": i in restarted,
                      "restarts": rec.get("restarts", 0), "first_round_after_restart": _resumed_at(rec)})
    accs = [r["test_accuracy"] for r in rounds if r["test_accuracy"] is not None]
    dropped: dict[str, int] = {}
    for p in peers:
        for k, v in (p["dropped"] or {}).items():
            dropped[k] = dropped.get(k, 0) + v
    summary = {
        "final_test_accuracy": accs[-1] if accs else None, "best_test_accuracy": max(accs) if accs else None,
        "total_bytes_up": sum(p["bytes_up"] or 0 for p in peers),
        "total_bytes_down": sum(p["bytes_down"] or 0 for p in peers),
        "model_bytes_up": sum(r["bytes_up"] for r in rounds), "wall_s": wall_s,
        "peers": len(peers), "killed": list(killed), "restarted": list(restarted), "dropped": dropped,
        "bytes_note": "total_* count every byte the peers' sockets moved (joins, heartbeats, envelopes); "
                      "rounds' bytes are those moved during each peer's rounds",
    }
    config = {"engine": "swarm", "strategy": spec.algorithm, "task": spec.task, "clients": spec.peers,
              "rounds": spec.rounds, "partition": spec.partition, "seed": spec.seed, "topology": spec.topology,
              "local_steps": spec.local_steps, "lr": spec.lr, "batch_size": spec.batch_size, "params": spec.params,
              "fail": f"{spec.fail[0]}@{spec.fail[1]}" if spec.fail else None}
    run_id = f"swarm-{spec.algorithm}-{int(time.time())}"
    return {"run_id": run_id, "config": config, "rounds": rounds, "summary": summary, "peers": peers}


def _resumed_at(rec: dict) -> int | None:
    rows = rec.get("rows") or []
    for prev, row in pairwise(rows):
        if row.get("restarts", 0) > prev.get("restarts", 0):
            return row["round"]
    return None
