"""The batched engine's federated evaluation: the whole cohort scored in one batched computation.

Each cohort node's ClientApp scores the model on its own validation split
(:func:`fedswarm.train.node_validation`, with :func:`fedswarm.train.evaluate_flat`): its loss
is the task's objective on its examples (a mean over them), its accuracy the share it gets
right. Here every node's examples are gathered into one batch (the splits as ``(flat, offsets)``,
cut once per run), each example's loss and correctness computed at once, and summed back per
node: node ``k``'s loss is the sum of its examples' losses over its count, as the objective's
mean is (the same numbers to float rounding; tests/test_fed_eval.py holds the engines to 1e-6).
The round's figures are :func:`fedswarm.server.fed_eval.aggregate`'s arithmetic on the arrays
(example-weighted means), so a 100,000-node cohort costs no dict per node; node rows (kept up to
``NODE_ROWS_MAX`` nodes) get their node's values.

Per-example correctness is known for the built-in accuracies (:func:`correct_of`); a task with
an accuracy of its own is scored node by node (:func:`fedswarm.server.fed_eval.cohort_on_partitions`),
as are the nodes with their own data (``--client-data``) when the split cannot be cut once.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from fedswarm.config import RunConfig
from fedswarm.params import set_flat
from fedswarm.server.fed_eval import aggregate, cohort_on_partitions, merge_into_rows
from fedswarm.tasks import Task
from fedswarm.tasks.base import accuracy_multiclass, cross_entropy
from fedswarm.tasks.partition import partition_offsets

__all__ = ["CohortEvaluator", "correct_of", "losses_of", "segment_gather"]

#: examples scored in one forward pass (bounds the evaluation's memory: a few MB for small models)
EVAL_CHUNK = 65_536


def correct_of(task: Task) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Per-example correctness ``(model output, y) -> bool [n]`` of ``task``'s accuracy (the
    share of examples for which it is true), or None for an accuracy this module does not know."""
    from fedswarm.tasks.builtin import logreg_accuracy

    if task.accuracy is accuracy_multiclass:
        return lambda out, y: out.argmax(dim=1) == y
    if task.accuracy is logreg_accuracy:
        return lambda out, y: (out.squeeze(-1) > 0).long() == y
    return None


def losses_of(task: Task) -> Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Per-example objective ``(model, model output, y) -> [n]`` for the built-in objectives
    (their mean over a batch is the objective), or None: then each example's objective is the
    task's own on a batch of one, under ``vmap``."""
    from fedswarm.tasks.builtin import LOGREG_L2, logreg_objective

    if task.objective is cross_entropy:
        return lambda model, out, y: F.cross_entropy(out, y, reduction="none")
    if task.objective is logreg_objective:
        def logreg(model, out, y):
            reg = sum((p * p).sum() for p in model.parameters())
            ell = F.binary_cross_entropy_with_logits(out.squeeze(-1), y.float(), reduction="none")
            return ell + 0.5 * LOGREG_L2 * reg
        return logreg
    return None


def segment_gather(flat: np.ndarray, offsets: np.ndarray, parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of partitions ``parts``, one after another: ``(flat rows, count per partition)``,
    without a Python loop over the partitions."""
    starts = offsets.take(parts)
    counts = offsets.take(parts + 1) - starts
    if (counts == 1).all():  # one row each (a cohort larger than the split's rows): no shift to build
        return flat.take(starts), counts
    total = int(counts.sum())
    shift = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return flat[np.arange(total, dtype=np.int64) + shift], counts


class CohortEvaluator:
    """The engine's ``fed_eval(rnd, vec, cohort)`` and, for a large cohort, its whole round's
    figures (:meth:`round_figures`). ``on_partition(pid, vec) -> (loss, accuracy, examples)`` is the
    node-by-node scoring, used where the batch cannot be formed."""

    def __init__(self, cfg: RunConfig, task: Task, model: torch.nn.Module, device: torch.device,
                 test_x: torch.Tensor, test_y: torch.Tensor,
                 on_partition: Callable[[int, torch.Tensor], tuple[float, float, int]]):
        self.task = task
        self.model = model
        self.device = device
        self.on_partition = on_partition
        self.correct = correct_of(task)
        self.losses = losses_of(task)
        self.x, self.y = test_x, test_y
        self.split: tuple[np.ndarray, np.ndarray] | None = None
        # :meth:`score` done elsewhere, ``(vec, pids) -> score's arrays``: the batched engine on Ray
        # scores each client on the worker that owns it (sim/batched_ray.py)
        self.scorer: Callable[[torch.Tensor, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        if self.correct is not None and not cfg.client_data:  # node_validation's cut of the test set
            self.split = partition_offsets(test_y.numpy(), "iid", cfg.clients, cfg.seed)

    @property
    def batched(self) -> bool:
        return self.split is not None

    def __call__(self, rnd: int, vec: torch.Tensor, cohort: list[int]) -> dict[str, dict]:
        """What each cohort node's ClientApp answers an evaluate message with."""
        if not self.batched:
            return cohort_on_partitions(cohort, lambda pid: self.on_partition(pid, vec))
        loss, acc, n = self.score(vec, np.asarray(cohort, dtype=np.int64) - 1)
        return {str(node): {"fed_loss": lo, "fed_accuracy": a, "fed_examples": k}
                for node, lo, a, k in zip(cohort, loss.tolist(), acc.tolist(), n.tolist())}

    def round_figures(self, rnd: int, vec: torch.Tensor, cohort: np.ndarray, node_rows: list[dict] | None
                      ) -> dict[str, Any]:
        """The round's federated fields, each node's values merged into its row of ``node_rows``:
        :meth:`fedswarm.server.recorder.RoundRecorder.federated`'s result, from arrays."""
        if len(cohort) == 0:
            return {}
        if not self.batched or node_rows:
            results = self(rnd, vec, [int(c) for c in cohort])
            merge_into_rows(results, node_rows)
            return aggregate(results)
        loss, acc, n = self.score(vec, np.asarray(cohort, dtype=np.int64) - 1)
        total = int(n.sum())  # aggregate()'s example-weighted means; every node here has examples
        return {"fed_loss": float((loss * n).sum() / total), "fed_accuracy": float((acc * n).sum() / total),
                "fed_examples": total}

    def score(self, vec: torch.Tensor, pids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each partition's ``(mean loss, accuracy, examples)`` (float64, float64, int64 arrays)."""
        if self.scorer is not None:
            return self.scorer(vec, pids)
        flat, offsets = self.split
        rows, counts = segment_gather(flat, offsets, pids)
        if (counts == 0).any():
            # evaluate_flat on no examples fails on the node: let it fail the same way
            raise ZeroDivisionError(f"federated evaluation: node {int(pids[counts == 0][0]) + 1} has no "
                                    "validation examples")
        # nodes share examples when the population passes the test set (the split cycles it): each
        # distinct example is scored once (a mask over the test set: the sorted distinct rows, no
        # sort of the cohort's rows), its values read back for every node that holds it
        seen = np.zeros(len(self.y), dtype=bool)
        seen[rows] = True
        distinct = np.flatnonzero(seen)
        loss_u, right_u = self._per_example(vec, distinct)
        at = np.empty((2, len(self.y)), dtype=np.float64)  # each test example's (loss, correct), where scored
        at[0, distinct], at[1, distinct] = loss_u.numpy(), right_u.numpy()
        per_row = np.take(at, rows, axis=1)  # (take: several times a fancy index's speed on 2-D)
        if len(rows) == len(pids):  # one example per node (no node without one): its values are the node's
            sums = per_row
        else:  # each node's examples are consecutive in rows: summed in order, segment by segment
            sums = np.add.reduceat(per_row, np.cumsum(counts) - counts, axis=1)
        return sums[0] / counts, sums[1] / counts, counts.astype(np.int64)

    def _per_example(self, vec: torch.Tensor, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Test examples ``rows``' objective values and correctness (float64 [n] each), in chunks."""
        set_flat(self.model, vec)
        self.model.eval()
        rows_t = torch.from_numpy(rows)
        loss = torch.empty(len(rows), dtype=torch.float64)
        right = torch.empty(len(rows), dtype=torch.float64)

        def one(xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return self.task.objective(self.model, xi[None], yi[None])

        with torch.no_grad():
            for lo in range(0, len(rows), EVAL_CHUNK):
                r = rows_t[lo:lo + EVAL_CHUNK]
                x, y = self.x[r].to(self.device), self.y[r].to(self.device)
                out = self.model(x)
                per_example = torch.vmap(one)(x, y) if self.losses is None else self.losses(self.model, out, y)
                loss[lo:lo + len(r)] = per_example.reshape(-1).cpu().to(torch.float64)
                right[lo:lo + len(r)] = self.correct(out, y).cpu().to(torch.float64)
        return loss, right
