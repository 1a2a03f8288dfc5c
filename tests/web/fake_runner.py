"""A stand-in for ``python -m fedswarm sim --run-id``: writes rounds to the store and obeys
controls like the real ServerApp, without torch. Tests point the dashboard's runner here.

Usage: fake_runner.py sim --db URL --run-id ID --config TOML
       fake_runner.py resume RUN_ID --db URL   (goes on after the run's last checkpoint)
Environment: FAKE_ROUND_S (seconds per round, default 0.15), FAKE_FAIL=1 (exit 1 at once),
FAKE_DIE_AFTER=N (exit 1 without a word after round N, checkpointing each round), and with it
FAKE_DIE_GATE=PATH (before dying, stay running until PATH exists: a test sees the run alive first).
"""

import argparse
import math
import os
import sys
import threading
import time
import tomllib

from fedswarm.store import Store

PAUSED_LIMIT_S = 300.0  # a test that pauses a run resumes or stops it well within this


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["sim", "resume"])
    ap.add_argument("run", nargs="?")
    ap.add_argument("--db")
    ap.add_argument("--run-id")
    ap.add_argument("--config")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if os.environ.get("FAKE_FAIL"):
        print("fake runner: failing on purpose", file=sys.stderr)
        return 1
    store = Store(args.db)
    rnd = 0
    if args.cmd == "resume":
        rid = args.run
        cfg = dict(store.get_run(rid).config)
        rnd = store.latest_checkpoint(rid).round
        print(f"fake runner: resuming run {rid} after round {rnd}", flush=True)
    else:
        rid = args.run_id
        with open(args.config, "rb") as f:
            cfg = tomllib.load(f)
    store.update_run(rid, pid=os.getpid())
    store.set_status(rid, "running")
    total = int(store.get_run(rid).total_rounds or cfg.get("rounds", 3))
    delay = float(os.environ.get("FAKE_ROUND_S", "0.15"))
    die_after = int(os.environ.get("FAKE_DIE_AFTER", "0")) if args.cmd == "sim" else 0
    print(f"fake runner: run {rid}, {total} rounds, strategy {cfg.get('strategy')}", flush=True)
    paused = False
    poll = threading.Event()  # never set: its wait() is the poll interval
    while True:
        for c in store.pending_controls(rid):
            if c.kind == "pause":
                paused = True
                store.set_status(rid, "paused")
            elif c.kind == "resume":
                paused = False
                store.set_status(rid, "running")
            elif c.kind == "stop":
                store.mark_applied(c.id)
                store.set_status(rid, "stopped")
                return 0
            elif c.kind == "add_rounds":
                total += int(c.payload["rounds"])
                store.update_run(rid, total_rounds=total)
            store.mark_applied(c.id)
        if paused:  # wait for the next control (resume, stop, ...), as the real runner polls the store
            deadline = time.monotonic() + PAUSED_LIMIT_S
            while not store.pending_controls(rid):
                if time.monotonic() > deadline:
                    store.set_status(rid, "failed", error=f"fake runner: paused over {PAUSED_LIMIT_S:.0f} s")
                    return 3
                poll.wait(0.05)
            continue
        if rnd >= total:
            break
        rnd += 1
        # the round's training time (FAKE_ROUND_S), cut short when a control arrives: the round is
        # recorded, then the control is applied, as the real runner does between rounds
        round_end = time.monotonic() + delay
        while time.monotonic() < round_end and not store.pending_controls(rid):
            poll.wait(min(0.05, max(0.0, round_end - time.monotonic())))
        acc = 1 - 0.9 * math.exp(-rnd / 3)
        store.add_round(rid, rnd, train_loss=2.3 * math.exp(-rnd / 4), test_loss=2.4 * math.exp(-rnd / 4),
                        test_accuracy=acc, bytes_up=1000 * int(cfg.get("clients", 4)),
                        bytes_down=2000 * int(cfg.get("clients", 4)), wall_s=delay, sim_time_s=2 * delay,
                        num_clients=int(cfg.get("clients", 4)))
        store.add_node_rounds(rid, rnd, [{"node_id": f"n{i}", "bytes_up": 1000, "bytes_down": 2000,
                                          "device_class": "edge-wifi" if i % 2 else "datacenter"}
                                         for i in range(int(cfg.get("clients", 4)))])
        print(f"round {rnd}: accuracy {acc:.3f}", flush=True)
        if die_after:
            store.add_checkpoint(rid, rnd, f"/nonexistent/{rid}-{rnd}.pt")
            if rnd >= die_after:
                gate = os.environ.get("FAKE_DIE_GATE")
                deadline = time.monotonic() + PAUSED_LIMIT_S
                while gate and not os.path.exists(gate) and time.monotonic() < deadline:
                    poll.wait(0.05)
                return 1
    store.set_status(rid, "finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
