"""gTop-k (``gtopk``) on the batched engine: the codec runner
(:class:`~fedswarm.sim.batched_compressed.CompressedRounds`: the strategy's sampling, replies,
bytes and aggregation) with gTop-k's client half,
:func:`fedswarm.strategies.federated.gtopk.client_step`, run on the chunk's clients at once.

Each gTop-k client keeps a memory between rounds (its accumulator, and the round and indices of
its last message, which the server's ``select`` record refers to); the batched engine holds them
in arrays for the clients that have one (:class:`GTopKRows`).
"""

from __future__ import annotations

import numpy as np
import torch

from fedswarm.sim.batched_compressed import CompressedRounds, sent_rows
from fedswarm.sim.batched_round import ClientRows
from fedswarm.strategies.federated import gtopk
from fedswarm.strategies.federated.compressed_base import KNOBS
from fedswarm.strategies.federated.compressed_client import SELECT
from fedswarm.strategies.federated.gtopk import GTopKClientState

__all__ = ["GTopKRounds", "GTopKRows"]


class GTopKRows:
    """The gTop-k clients' memories held as arrays, for the clients that have one: accumulators
    and last sent indices as rows (:class:`~fedswarm.sim.batched_round.ClientRows`, ``[d]`` and
    ``[k]``), the round of the last message in an int32 array over the population (-1: none
    yet, the state :meth:`GTopKClientState.empty` a client starts from). Its memory: ``12 x
    population`` bytes of slots (the two row sets') and rounds, plus ``4 d + 8 k`` bytes per client
    that has state."""

    def __init__(self, d: int, population: int):
        self.acc = ClientRows(d, population)
        self.sent_round = np.full(population, -1, dtype=np.int32)
        self.sent_idx: ClientRows | None = None  # [k] int64 rows, made at the first keep (k known then)

    def state(self, pids: list[int]) -> GTopKClientState:
        """Clients ``pids``' memories as one batch."""
        rounds = self.sent_round[np.asarray(pids, dtype=np.int64)].tolist()
        idx = self.sent_idx.stack(pids) if self.sent_idx is not None else None
        return GTopKClientState(self.acc.stack(pids), tuple(None if r < 0 else r for r in rounds),
                                tuple(None if r < 0 else idx[i] for i, r in enumerate(rounds)))

    def keep(self, pids: list[int], state: GTopKClientState) -> None:
        """Clients ``pids``' memories after their round (every one sent: a round and indices each)."""
        if any(r is None for r in state.sent_round) or any(i is None for i in state.sent_idx):
            raise ValueError("GTopKRows.keep: a client state with no message sent")
        idx = torch.stack(list(state.sent_idx)) if state.sent_idx else torch.zeros((0, 0), dtype=torch.int64)
        if self.sent_idx is None:
            self.sent_idx = ClientRows(idx.shape[1], len(self.sent_round), dtype=torch.int64)
        if idx.shape[1] != self.sent_idx.d:
            raise ValueError(f"GTopKRows.keep: {idx.shape[1]} indices a client, the run's clients send "
                             f"{self.sent_idx.d}")
        self.acc.keep_stacked(pids, state.acc)
        self.sent_idx.keep_stacked(pids, idx)
        self.sent_round[np.asarray(pids, dtype=np.int64)] = np.asarray(state.sent_round, dtype=np.int32)

    def nbytes(self) -> int:
        """Bytes held: slots, rounds and rows."""
        return (self.acc.nbytes() + self.sent_round.nbytes
                + (self.sent_idx.nbytes() if self.sent_idx is not None else 0))


class GTopKRounds(CompressedRounds):
    """gTop-k (``gtopk``): the clients' half is
    :func:`~fedswarm.strategies.federated.gtopk.client_step` on the chunk's clients at once,
    each with its own :class:`~fedswarm.strategies.federated.gtopk.GTopKClientState` row."""

    def __init__(self, run, model: torch.Tensor, notes=None):
        super().__init__(run, model, notes)
        self.states = GTopKRows(self.layout.d, run.cfg.clients)  # arrays: only the clients that have a memory

    def _client_step(self, delta, pids, ins, policies):
        knobs = ins[0].content.config_records[KNOBS]
        state = self.states.state(pids)
        selects = [m.content.config_records.get(SELECT) for m in ins]
        payload, state = gtopk.client_step(state, selects, delta, float(knobs["density"]), int(knobs["round"]),
                                           self.layout)
        self.states.keep(pids, state)
        if self.capture is not None:  # a shard worker's client half (CompressedRounds.capture)
            self.capture.payload(payload, pids, int(payload.meta["seed"]))
            return [None] * len(pids), [None] * len(pids)
        values = [(idx.to(torch.int64), vals.to(torch.float32))  # what GlobalTopK.parse_reply returns
                  for idx, vals in zip(payload.arrays["indices"], payload.arrays["values"])]
        return values, sent_rows(payload, int(payload.meta["seed"]))
