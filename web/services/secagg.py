"""Secure aggregation on the run page: each round's protocol figures, read from the round's
``metrics`` JSON as the server's ``SecAggGrid`` writes them (``secagg``: participants, nodes
per stage, dropped after sharing, recovered, threshold, field bits, bytes per stage;
``secagg_failed`` for a round that could not finish; ``secagg_values``: the same figures of
Sketched-SGD's second sum, a row of its own). Read defensively: a key missing or of
another type shows as blank, never breaks the page.

The protocol's byte overhead of a round is what its advertise, share-keys and unmask stages
sent (both ways): the masked-input stage carries what a plain round would (the model down,
one vector up); the share is that overhead over the masked-input stage's bytes.
"""

from __future__ import annotations

from typing import Any

from fedswarm.store import Store

__all__ = ["secagg_rounds", "secagg_on"]

_PLAIN_STAGE = "masked_input"


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _stage_bytes(b: Any) -> int:
    if not isinstance(b, dict):
        return 0
    return sum(x for x in (_int(b.get("up")), _int(b.get("down"))) if x is not None)


def secagg_on(config: dict | None) -> bool:
    """Whether a run's config asked for secure aggregation."""
    return bool((config or {}).get("secagg"))


#: A round's secure sums: the metrics key of each and its label on the page (Sketched-SGD's second
#: sum, the exact values at the server's candidates, is ``secagg_values``; every other strategy has one)
_SUMS = (("secagg", None), ("secagg_values", "values"))


def secagg_rounds(store: Store, run_id: str, limit: int = 1000) -> list[dict]:
    """One dict per secure sum a round ran (or tried), oldest first, at most ``limit``; ``sum``
    names a round's second sum (None for its first)."""
    out = []
    for r in store.rounds(run_id):
        metrics = r.metrics if isinstance(r.metrics, dict) else {}
        for key, label in _SUMS:
            sa = metrics.get(key)
            if not isinstance(sa, dict):
                continue
            stages = sa.get("bytes") if isinstance(sa.get("bytes"), dict) else {}
            nodes = sa.get("nodes") if isinstance(sa.get("nodes"), dict) else {}
            plain = _stage_bytes(stages.get(_PLAIN_STAGE))
            protocol = sum(_stage_bytes(v) for k, v in stages.items() if k != _PLAIN_STAGE)
            # each sum's row names its own failure; a round-level reason belongs to the round's only sum
            one_sum = not isinstance(metrics.get("secagg_values"), dict)
            failed = sa.get("failed") or (metrics.get("secagg_failed") if one_sum else None)
            out.append({
                "round": r.round, "sum": label, "participants": _int(sa.get("participants")),
                "masked": _int(nodes.get(_PLAIN_STAGE)),
                "dropped_after_sharing": _int(sa.get("dropped_after_sharing")), "recovered": _int(sa.get("recovered")),
                "threshold": _int(sa.get("threshold")), "field_bits": _int(sa.get("field_bits")),
                "protocol_bytes": protocol, "overhead": protocol / plain if plain else None,
                "epsilon": metrics.get("epsilon") if isinstance(metrics.get("epsilon"), (int, float)) else None,
                "failed": str(failed) if failed else None,
            })
    return out[-limit:]
