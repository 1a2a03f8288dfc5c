"""The run page's secure-aggregation rows, read from a real store: one row per secure sum a round ran,
Sketched-SGD's second sum (``secagg_values``) a row of its own with its own figures and failure."""

from __future__ import annotations

from fedswarm.store import Store
from fedswarm.web.services.secagg import secagg_rounds


def _sum(participants: int, masked: int, protocol_down: int, failed: str | None = None) -> dict:
    stages = {"advertise": {"down": protocol_down, "up": 0}, "masked_input": {"down": 1000, "up": 1000}}
    row = {"participants": participants, "nodes": {"masked_input": masked}, "bytes": stages,
           "dropped_after_sharing": participants - masked, "recovered": participants - masked, "threshold": 3,
           "field_bits": 32}
    if failed:
        row["failed"] = failed
    return row


def test_each_secure_sum_is_a_row_and_names_its_own_failure(tmp_path):
    store = Store(tmp_path / "s.db")
    try:
        rid = store.create_run({"strategy": "sketched_sgd", "secagg": True})
        store.add_round(rid, 1, metrics={"secagg": _sum(5, 5, 100), "secagg_values": _sum(5, 4, 50)})
        store.add_round(rid, 2, metrics={"secagg": _sum(5, 5, 100), "secagg_failed": "too few nodes",
                                         "secagg_values": _sum(5, 1, 50, failed="too few nodes")})
        store.add_round(rid, 3, metrics={"secagg": _sum(4, 2, 80), "secagg_failed": "below the threshold"})
        rows = secagg_rounds(store, rid)
    finally:
        store.close()
    assert [(r["round"], r["sum"]) for r in rows] == [(1, None), (1, "values"), (2, None), (2, "values"), (3, None)]
    assert [r["masked"] for r in rows] == [5, 4, 5, 1, 2]
    assert [r["overhead"] for r in rows] == [0.05, 0.025, 0.05, 0.025, 0.04]  # protocol bytes / masked-input bytes
    # round 2's second sum failed, not its first; a one-sum round takes the round's reason
    assert [r["failed"] for r in rows] == [None, None, None, "too few nodes", "below the threshold"]
