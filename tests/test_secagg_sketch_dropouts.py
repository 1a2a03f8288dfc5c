"""Sketched-SGD under --secagg on the in-process engine, nodes lost after sharing (at the
masked-input stage) in each of its round's two secure sums: with 1 and with n - t such dropouts
each sum is the exact weighted mean of its survivors' vectors (within one rounding unit per
node), the oracle being what each node masked, captured on the node; past the threshold the sum
fails cleanly, the round's row naming the sum and the reason, and the run goes on."""

from __future__ import annotations

import numpy as np

from fedswarm.algorithms.secagg import SecAggParams, SecAggServer
from fedswarm.client import secagg_mod
from fedswarm.server import secagg as server_secagg
from fedswarm.strategies.secagg_payload import payload_of
from fedswarm.wire import payload_from_records
from tests import test_secagg_flower as flower

#: the grid's secure rounds (two per server round) -> the nodes lost after sharing. 5 nodes: complete
#: graph, t = 3; the values' sum has the tables' survivors (3 nodes: t = 2)
LOST = {1: {2, 4},  # round 1, tables: n - t = 2
        2: {3},     # round 1, values over {1, 3, 5}: n - t = 1
        3: {5},     # round 2, tables: 1
        4: {1, 2, 3},  # round 2, values over {1, 2, 3, 4}: t = 3, 1 left: past the threshold
        5: {1, 2, 3}}  # round 3, tables: 2 left, past the threshold (no values' sum)


def test_sketched_sgd_secure_sums_with_dropouts_after_sharing(store, monkeypatch):
    sums: list[dict] = []  # per secure round: {"sent": node -> (vector, weight), "reply": the one reply}

    def scripted(node_ids, rate, seed, round_):
        return {"masked_input": LOST[round_] & set(node_ids)}

    def capture_payload(reply):
        vector, weight, spec = payload_of(reply)
        sums[-1]["sent"][int(reply.metadata.src_node_id)] = (vector.copy(), weight)
        return vector, weight, spec

    secure_round = server_secagg.SecAggGrid._secure_round

    def capture_round(self, train, timeout):
        sums.append({"sent": {}, "nodes": sorted(int(m.metadata.dst_node_id) for m in train)})
        out = secure_round(self, train, timeout)
        sums[-1]["reply"] = out[0] if out else None
        sums[-1]["params"] = self.params
        return out

    monkeypatch.setattr(server_secagg, "draw_dropouts", scripted)
    monkeypatch.setattr(secagg_mod, "payload_of", capture_payload)
    monkeypatch.setattr(server_secagg.SecAggGrid, "_secure_round", capture_round)
    cfg, rid, status, _, _ = flower._run(store, strategy="sketched_sgd", clients=5, rounds=3, seed=3, secagg=True,
                                         secagg_dropout=0.01, params={"density": 0.05})
    assert status == "finished"  # the failed sums cost their rounds, not the run
    rows = flower._rows(store, rid)[1:]
    assert len(sums) == 5 and [s["nodes"] for s in sums[:3]] == [[1, 2, 3, 4, 5], [1, 3, 5], [1, 2, 3, 4, 5]]
    for k in (1, 2, 3):  # the exact weighted mean of the survivors' vectors
        s = sums[k - 1]
        survivors = sorted(set(s["nodes"]) - LOST[k])
        assert sorted(s["sent"]) == s["nodes"]  # every node masked (the lost ones' inputs never arrived)
        # a node's values are weighted by its sketch's examples: the weight its table was sent with
        tables = sums[0] if k == 2 else s
        w = np.array([tables["sent"][i][1] for i in survivors], dtype=np.float64)
        clip = s["params"].clip
        x = np.stack([np.clip(s["sent"][i][0], -clip, clip) for i in survivors])
        oracle = (w[:, None] * x).sum(0) / w.sum()
        got = next(iter(payload_from_records(s["reply"].content).arrays.values())).reshape(-1).astype(np.float64)
        q = SecAggServer(s["nodes"], x.shape[1], SecAggParams(bits=cfg.secagg_bits)).quantizer
        cell = len(s["nodes"]) / (w.sum() * q.scale)  # one rounding unit per node
        assert np.abs(oracle).max() > 100 * cell  # a real mean
        assert np.max(np.abs(got - oracle)) <= cell + 1e-6 * np.abs(oracle).max(), k  # + float32
        assert int(s["reply"].content.metric_records["metrics"]["num-examples"]) == int(w.sum())
    r1, r2, r3 = rows
    assert r1["secagg"]["dropped_after_sharing"] == 2 and r1["secagg"]["recovered"] == 2
    assert r1["secagg_values"]["participants"] == 3 and r1["secagg_values"]["recovered"] == 1
    assert r2["secagg"]["recovered"] == 1 and "secagg_failed" not in r1
    assert "1 nodes sent a masked input, fewer than the threshold 3" in r2["secagg_failed"]
    assert r2["secagg_values"]["failed"] == r2["secagg_failed"] and "failed" not in r2["secagg"]
    assert "2 nodes sent a masked input, fewer than the threshold 3" in r3["secagg_failed"]
    assert r3["secagg"]["failed"] == r3["secagg_failed"] and "secagg_values" not in r3
    assert sums[3]["reply"] is None and sums[4]["reply"] is None
