"""What a SQuARM reply through the Flower router is made of, and bytes_up against the codec.

    python scripts/squarm_framing.py [TASK [RATIO [REPORT_EVERY]]]   # default digits-mlp 0.01 1

Runs 4 nodes x 3 rounds of SQuARM (top-k, period 1, ring) on the in-process engine,
prints one reply of round 2 split into its serialized parts (Flower's message metadata,
each record, each array's bytes: Flower stores an Array as .npy bytes, a 128-byte header
plus the raw data) and the recorded round rows: bytes_up per node against the codec's
formula 8k, and bytes_report (the dense model reports, monitoring).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from flwr.app import RecordDict
from flwr.common.serde import metadata_to_proto, recorddict_to_proto

from fedswarm.algorithms.decentralized import make_algorithm
from fedswarm.config import RunConfig
from fedswarm.server import metered_grid
from fedswarm.sim.run import run_engine
from fedswarm.store import Store
from fedswarm.tasks import get_task


def main() -> None:
    task = sys.argv[1] if len(sys.argv) > 1 else "digits-mlp"
    ratio = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    report_every = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.set_num_threads(1)
    n = 4
    cfg = RunConfig(strategy="squarm", task=task, clients=n, rounds=3, lr=0.05, batch_size=8, seed=0, local_steps=1,
                    topology="ring", params={"codec": "topk", "ratio": ratio, "period": 1, "threshold": 0.0,
                                             "report_every": report_every})
    replies: list = []
    count_up = metered_grid.MeteredGrid._count_up

    def spy(self, batch):
        replies.append(list(batch))
        return count_up(self, batch)

    metered_grid.MeteredGrid._count_up = spy
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "f.db")
        run_id = store.create_run(cfg.model_dump())
        assert run_engine(cfg, store=store, run_id=run_id) == "finished"
        rounds = store.export_result(run_id)["rounds"]
    d = sum(p.numel() for p in get_task(task).model(0).parameters())
    formula = make_algorithm("squarm", codec="topk", ratio=ratio).payload_bytes(d)
    m = replies[2][0]  # exchange 2 = round 2's messages
    total = metered_grid.serialized_size(m)
    print(f"{task} (d={d}), top-{ratio:g}: codec formula 8k = {formula} B; one round-2 reply = {total} B")
    print(f"  Flower message metadata: {metadata_to_proto(m.metadata).ByteSize()} B")
    for name, rec in m.content.items():
        size = recorddict_to_proto(RecordDict({name: rec})).ByteSize()
        print(f"  record {name!r} ({type(rec).__name__}): {size} B")
        if type(rec).__name__ == "ArrayRecord":
            for k in rec.keys():
                a = rec[k]
                raw = int(torch.tensor(a.shape).prod()) * (4 if "32" in a.dtype else 8)
                print(f"      array {k}: {a.dtype} {a.shape}, {len(a.data)} B of .npy (raw {raw} B)")
        else:
            print(f"      {dict(rec)}")
    print("round  bytes_up/node  /formula  bytes_report/node  test_accuracy")
    for r in rounds[1:]:
        rep = r.get("bytes_report")
        print(f"{r['round']:>5}  {r['bytes_up'] / n:>13.0f}  {r['bytes_up'] / n / formula:>8.3f}  "
              f"{'-' if rep is None else f'{rep / n:.0f}':>17}  {r['test_accuracy']}")


if __name__ == "__main__":
    main()
