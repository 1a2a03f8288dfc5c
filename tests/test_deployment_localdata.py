"""Edge devices that train on their own data: a real SuperLink and three SuperNodes on loopback,
each started with ``fedswarm client --data`` on files only it has (an .npz, an ImageFolder of
PNGs, a CSV), with class skews. Two rounds of digits-mlp: every node trains every round on its
own train split, and the global model learns the digits (the nodes' data is the run's training
pool, never its test set). The commands are the ones docs/devices.md shows."""

import sys

import numpy as np
import pytest

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.train import task_data
from tests.deployment_helpers import ROOT, Deployment
from tests.helpers import free_port, runs_ended
from tests.localdata_helpers import write_csv, write_image_folder, write_npz

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]  # a loaded 2-core machine: minutes
SEED = 0
#: Two rounds: every assertion below holds per round or compares the last round with the first (each
#: round starts 6 ClientApp processes, train and evaluate; round 2 already scores ~0.92).
ROUNDS = 2


def _device_data(tmp):
    """The run's training pool split in three with class skews: node k holds 80% of its
    examples from the classes c with c % 3 == k. Returns each node's path and example count."""
    data = task_data(RunConfig(seed=SEED))
    x, y = data.train_x.numpy(), data.train_y.numpy()
    rng = np.random.default_rng(1)
    home = y % 3
    owner = np.where(rng.random(len(y)) < 0.8, home, (home + rng.integers(1, 3, len(y))) % 3)
    parts = [np.flatnonzero(owner == k) for k in range(3)]
    paths = [write_npz(tmp / "node0.npz", x[parts[0]], y[parts[0]]),
             write_image_folder(tmp / "node1-images", x[parts[1]], y[parts[1]]),
             write_csv(tmp / "node2.csv", x[parts[2]], y[parts[2]])]
    return paths, [len(p) for p in parts]


def test_three_devices_train_on_their_own_data(tmp_path):
    paths, sizes = _device_data(tmp_path)
    train_sizes = sorted(n - round(0.2 * n) for n in sizes)  # --val-fraction 0.2 held out on each node
    val_sizes = sorted(round(0.2 * n) for n in sizes)
    db = tmp_path / "store.db"
    dep = Deployment(tmp_path, hold="")
    try:
        dep.start(0)  # the SuperLink
        for i, path in enumerate(paths):
            dep._spawn([sys.executable, "-m", "fedswarm", "client", "--superlink", f"127.0.0.1:{dep.port}",
                        "--insecure", "--data", str(path), "--partition-id", str(i), "--num-partitions", "3",
                        "--device-class", "cpu", "--clientappio-port", str(free_port()),
                        "--state-dir", str(tmp_path / f"node-state-{i}")])
        # the server holds no data: only the devices' own validation splits score the model
        dep.flwr("run", str(ROOT), "test", "--run-config",
                 f"rounds={ROUNDS} clients=3 seed={SEED} central_eval=false db='{db}'")
        runs = dep.wait(lambda: runs_ended(db), 600, interval=0.5, what="the run finishing")
        assert runs[0].status == "finished", dep.logs()
        store = Store(db)
        rows = [r for r in store.node_rounds(runs[0].id) if r.round > 0]
        for rnd in range(1, ROUNDS + 1):
            mine = [r for r in rows if r.round == rnd]
            assert len(mine) == 3 and all(r.status == "ok" for r in mine), (rnd, mine)
            assert sorted(r.num_examples for r in mine) == train_sizes, rnd
            assert sorted(r.fed_examples for r in mine) == val_sizes, rnd  # each scored on its own split
            for r in mine:  # what the device measured, in every node-round row
                assert r.telemetry and r.telemetry["train_s"] > 0 and r.telemetry["peak_rss_mb"] > 0, r.telemetry
                assert r.telemetry["cpu_count"] >= 1 and r.telemetry["examples_per_s"] > 0, r.telemetry
        rounds = [r for r in store.rounds(runs[0].id) if r.round > 0]
        assert all(r.test_accuracy is None for r in rounds)  # no central evaluation at all
        fed = [r.fed_accuracy for r in rounds]
        assert len(fed) == ROUNDS and all(a is not None for a in fed), fed
        assert all(r.fed_examples == sum(val_sizes) for r in rounds)
        assert fed[-1] > 0.85 and fed[-1] > fed[0], fed
        store.close()
    finally:
        dep.stop()
