"""Swarm transport and round time, measured (wall-clock, this machine, loopback).

1. **Model exchange**: a 10M-parameter float32 model (40 MB) pushed from one peer to
   another in a separate process, several ways in turn in one run: a raw socket copy
   of the same bytes (connect, ``sendall`` → ``recv_into`` one preallocated, warm buffer, a
   small ack; no authentication and no validation: the reference ``vs raw`` divides), the
   same with the finiteness check a peer must do (``raw_checked``, still unauthenticated); the
   swarm without TLS (signed header, Poly1305 body tag), the same over a Noise session (the
   swarm's default without TLS: an XX handshake on every connection, the median of its wall
   time in ``handshake_ms``, then every byte AES-256-GCM under forward-secret session keys;
   ``vs raw, handshake apart`` divides by the median of each exchange less its own
   connection's handshake, as over a session already open), the same with each body's records
   encrypted on a second thread while earlier ones are written (``pipelined``, what a peer
   does with ``FEDSWARM_NOISE_PIPELINE=on``; the row a peer here would use is marked), the
   legacy static-key encryption (bodies AES-256-GCM
   under keys from the identity keys, no handshake, no forward secrecy); and the swarm as a
   permissioned swarm runs it, with mutual TLS (encrypted, certificates from the swarm's
   CA bound to the signing keys; a TLS 1.3 session ticket from the previous exchange
   resumes the session, as between gossiping neighbours; the first, full handshake is
   ``seconds_first``). Every swarm path validates dtype, length and finiteness on arrival
   (a float32 body is scanned for non-finite values chunk by chunk as it arrives,
   :class:`~fedswarm.swarm.net.bodies.FiniteScan`) and answers with a signed ack; a received
   body reuses the buffer of an earlier one once
   nothing refers to it (:class:`~fedswarm.swarm.net.bodies.BodyPool`), as the raw socket
   reuses its one buffer. Median of the reps (7 quick, 15 full; the paths take turns in each
   round, their order rotating from round to round, so a slow spell of the machine falls on
   all of them alike); the load average is recorded beside
   the figures, and so is each side's CPU time per exchange (``send_cpu_ms``,
   ``recv_cpu_ms``: thread CPU time, much less sensitive than wall time to a loaded
   machine; a transfer cannot be faster than its busier side's CPU time). Each exchange row has
   its p90 too; when the raw exchange's p90 is over 1.5x its median the run warns that its
   ratios are noise (on a shared 2-core VM the raw exchange took 8 ms in some reps and 25 ms in
   others of one run; a run that is slow throughout is not caught: compare its raw row).
2. **Gossip round, 16 peers, digits-mlp** (D-PSGD on a ring, one local step per round):
   the swarm's round period = median over rounds of the time between the last peer
   finishing round r−1 and the last peer finishing round r. Quick: 16 peers as threads of
   one process (real sockets, one GIL); full: also 16 peer processes.
3. **Flower** (full mode only, when ``flower-superlink`` is installed): FedAvg on the same
   model through a SuperLink with 16 SuperNodes on this machine; the round time recorded
   by fedswarm's ServerApp (SuperNodes poll the SuperLink every 3 s). Flower's run config
   takes only the keys of ``[tool.flwr.app.config]``, so clients train the default
   ``local_epochs=2`` (about 12 steps of 16 examples), not one step: compute is still
   negligible next to the polling.

    python -m fedswarm.bench.swarm --quick --out out/      # or: fedswarm bench swarm

Writes ``OUT/swarm.json`` (the rows) and ``OUT/swarm.png``, prints a table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

from fedswarm.bench.swarm_exchange import exchange_rows, profile_rows
from fedswarm.procs import stop_process_groups

__all__ = ["main", "run"]

PEERS, TASK = 16, "digits-mlp"
ROOT = Path(__file__).resolve().parents[1]


# -- 2. swarm round time ---------------------------------------------------------------
def _round_period(histories: list[list[dict]], skip: int = 2) -> tuple[float, float, int]:
    """(median, p90) over rounds of the time between the last peer finishing r-1 and r."""
    last: dict[int, float] = {}
    for rows in histories:
        for row in rows:
            last[row["round"]] = max(last.get(row["round"], 0.0), row["t"])
    rs = sorted(last)
    gaps = sorted(last[b] - last[a] for a, b in pairwise(rs) if b == a + 1 and a >= skip)
    if not gaps:
        return float("nan"), float("nan"), 0
    return statistics.median(gaps), gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))], len(gaps)


def round_rows_threads(rounds: int) -> dict:
    from fedswarm.swarm.net.identity import create_or_load
    from fedswarm.swarm.peer import Peer, PeerConfig

    with tempfile.TemporaryDirectory() as tmp:
        idents = [create_or_load(Path(tmp) / f"p{i}") for i in range(PEERS)]
        allow = Path(tmp) / "allow.txt"
        allow.write_text("\n".join(i.peer_id for i in idents))
        peers, first = [], None
        for i in range(PEERS):
            cfg = PeerConfig(join=[first] if first else [], algorithm="dpsgd", task=TASK, num_partitions=PEERS,
                             partition_id=i, rounds=rounds, local_steps=1, lr=0.3, allow=str(allow),
                             state_dir=f"{tmp}/s{i}", min_peers=PEERS, round_timeout_s=30, heartbeat_s=0.5,
                             linger_s=2.0)
            peers.append(Peer(cfg, identity=idents[i]))
            first = first or peers[0].transport.address
        out: list = [None] * PEERS
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, peers[i].run())) for i in range(PEERS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
    med, p90, n = _round_period([o["rows"] for o in out if o])
    per_peer = statistics.median(r["wall_s"] for o in out if o for r in o["rows"][2:])
    return {"benchmark": "round", "runtime": "swarm: 16 peers as threads of 1 process", "peers": PEERS,
            "model": TASK, "rounds": n, "round_s": med, "round_s_p90": p90, "peer_round_s_median": per_peer,
            "bytes_per_round": sum(r["bytes_up"] for o in out if o for r in o["rows"]) / max(1, rounds)}


def round_rows_processes(rounds: int) -> dict:
    from fedswarm.swarm.launcher import SwarmSpec, launch_swarm

    with tempfile.TemporaryDirectory() as tmp:
        spec = SwarmSpec(peers=PEERS, algorithm="dpsgd", rounds=rounds, out=Path(tmp), local_steps=1, lr=0.3,
                         round_timeout_s=30, heartbeat_s=0.5, timeout_s=500, save_models=False)
        launch_swarm(spec, log=lambda m: None)
        hist = []
        for i in range(PEERS):
            f = Path(tmp) / "peers" / f"p{i}" / "result.json"
            hist.append(json.loads(f.read_text())["rows"] if f.exists() else [])
    med, p90, n = _round_period(hist)
    per_peer = statistics.median(r["wall_s"] for rows in hist for r in rows[2:]) if n else float("nan")
    return {"benchmark": "round", "runtime": "swarm: 16 peer processes", "peers": PEERS, "model": TASK, "rounds": n,
            "round_s": med, "round_s_p90": p90, "peer_round_s_median": per_peer}


# -- 3. Flower SuperLink + 16 SuperNodes -------------------------------------------------
def round_row_flower(rounds: int, budget_s: float = 600.0) -> dict:
    row = {"benchmark": "round", "runtime": "Flower: SuperLink + 16 SuperNodes (FedAvg)", "peers": PEERS,
           "model": TASK, "rounds": 0, "round_s": None, "round_s_p90": None}
    if shutil.which("flower-superlink") is None or shutil.which("flwr") is None:
        return {**row, "note": "flwr CLI not installed"}
    from fedswarm.store import Store

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    tmp = Path(tempfile.mkdtemp(prefix="bench-flower-"))
    env = dict(os.environ, FLWR_HOME=str(tmp / "flwr"), PYTHONUNBUFFERED="1")
    (tmp / "flwr").mkdir()
    port = free_port()
    (tmp / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    db, procs = tmp / "store.db", []
    log = open(tmp / "processes.log", "w")
    def spawn(cmd):
        return procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                          start_new_session=True))
    try:
        spawn(["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port), "--database",
               str(tmp / "state.db"), "--disable-runtime-dependency-installation"])
        time.sleep(3)
        for i in range(PEERS):
            spawn([sys.executable, "-m", "fedswarm", "client", "--superlink", f"127.0.0.1:{port}", "--insecure",
                   "--partition-id", str(i), "--num-partitions", str(PEERS), "--device-class", "cpu",
                   "--clientappio-port", str(free_port())])
        started = subprocess.run(["flwr", "run", str(ROOT), "bench", "--run-config",
                                  f"rounds={rounds} clients={PEERS} db='{db}'"],
                                 capture_output=True, text=True, env=env, timeout=120, check=False)
        if started.returncode != 0:
            return {**row, "note": "flwr run failed: " + " ".join((started.stdout + started.stderr).split())[-200:]}
        deadline, walls = time.monotonic() + budget_s, []
        while time.monotonic() < deadline:
            if db.exists():
                store = Store(db)
                runs = store.list_runs()
                done = runs and runs[0].status in ("finished", "failed")
                walls = [r.wall_s for r in store.rounds(runs[0].id) if r.round > 0] if runs else []
                store.close()
                if done:
                    break
            time.sleep(2)
        if not walls:
            return {**row, "note": f"no round finished within {budget_s:.0f} s"}
        row["first_round_s"] = walls[0]  # includes starting 16 ClientApp processes
        steady = walls[1:]
        if not steady:
            return {**row, "rounds": 1, "note": f"only round 1 ({walls[0]:.0f} s, with ClientApp start-up) "
                                                f"finished within {budget_s:.0f} s"}
        return {**row, "rounds": len(steady), "round_s": statistics.median(steady), "round_s_p90": max(steady)}
    finally:
        stop_process_groups(procs)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


# -- driver ----------------------------------------------------------------------------
def run(out_dir: Path, quick: bool = False, exchange_only: bool = False, profile: bool = False) -> list[dict]:
    """Run the measurements, write ``swarm.json`` and ``swarm.png``, print the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = exchange_rows(reps=7 if quick else 15)
    if profile:
        rows += profile_rows()
    if not exchange_only:
        rows.append(round_rows_threads(rounds=12 if quick else 30))
    if not quick and not exchange_only:
        rows.append(round_rows_processes(rounds=20))
        rows.append(round_row_flower(rounds=4))
    (out_dir / "swarm.json").write_text(json.dumps(rows, indent=2, default=str))
    _table(rows)
    warning = unsteady(rows)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    _plot(rows, out_dir / "swarm.png")
    return rows


def _p90(xs: list[float]) -> float:
    """The 90th percentile of ``xs`` (nearest rank): how far the slow reps stray from the median."""
    return sorted(xs)[max(0, math.ceil(0.9 * len(xs)) - 1)] if xs else float("nan")


def unsteady(rows: list[dict]) -> str | None:
    """Why this run's exchange ratios are noise (the raw exchange's p90 over 1.5x its median), or None."""
    for r in rows:
        if r["benchmark"] == "exchange" and r["path"] == "raw" and _p90(r["seconds_all"]) > 1.5 * r["seconds"]:
            return (f"this machine's timings are unsteady (the raw exchange's p90 {_p90(r['seconds_all']):.3f} s is "
                    f"over 1.5x its median {r['seconds']:.3f} s): the ratios of this run are noise; run it again on "
                    "a quieter machine")
    return None


def _table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="swarm on loopback (wall-clock seconds, this machine)")
    for col in ("measure", "what", "seconds (median)", "MB/s", "vs raw", "vs raw, handshake apart", "p90 s",
                "CPU ms send/recv", "handshake ms"):
        t.add_column(col, justify="right" if col != "what" else "left")
    def f(v, spec):
        return "-" if v is None or not math.isfinite(v) else format(v, spec)
    for r in rows:
        if r["benchmark"] == "profile":
            t.add_row("profile, 40 MB", r["step"], "-", "-", "-", "-", "-", f"{r['ms']:.1f} (CPU)", "-")
        elif r["benchmark"] == "exchange":
            t.add_row("exchange 40 MB", r["transport"], f(r["seconds"], ".3f"), f(r["MBps"], ".0f"),
                      f(r["ratio_vs_raw"], ".2f"), f(r.get("ratio_vs_raw_handshake_apart"), ".2f"),
                      f(_p90(r["seconds_all"]), ".3f"),
                      f"{r['send_cpu_ms']:.0f} / {r['recv_cpu_ms']:.0f}",
                      f(r.get("handshake_ms"), ".2f"))
        else:
            t.add_row("round, 16 peers", r["runtime"] + (f" ({r['note'][:60]})" if r.get("note") else ""),
                      f(r["round_s"], ".3f"), "-", "-", "-", f(r["round_s_p90"], ".3f"), "-", "-")
    console = Console()
    (console if console.is_terminal else Console(width=160)).print(t)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ex = [r for r in rows if r["benchmark"] == "exchange"]
    rd = [r for r in rows if r["benchmark"] == "round" and r.get("round_s")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar([r["path"] for r in ex], [r["MBps"] for r in ex],
                color=["#888", "#2a7", "#a72", "#c55", "#27a"][: len(ex)])
    axes[0].set_ylabel("MB/s (40 MB model, loopback)")
    axes[0].set_title("model exchange throughput")
    axes[1].bar([r["runtime"].replace(": ", "\n") for r in rd], [r["round_s"] for r in rd], color="#27a")
    axes[1].set_ylabel("seconds per round (median)")
    if rd and max(r["round_s"] for r in rd) > 20 * min(r["round_s"] for r in rd):
        axes[1].set_yscale("log")  # Flower's 3 s polling next to sub-second swarm rounds
    axes[1].set_title("16 peers, digits-mlp, one local step")
    axes[1].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--exchange-only", action="store_true",
                    help="only the 40 MB exchange (raw, raw + finiteness check, plain, Noise-encrypted (in turn and "
                         "pipelined), static-key "
                         "encrypted, mutual TLS)")
    ap.add_argument("--profile", action="store_true",
                    help="also time each step of an exchange in-process (handshakes, copies, crypto, checks)")
    a = ap.parse_args(argv)
    run(a.out, quick=a.quick, exchange_only=a.exchange_only, profile=a.profile)


if __name__ == "__main__":
    main()
