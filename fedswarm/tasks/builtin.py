"""Built-in tasks: scikit-learn's handwritten digits (ships inside the package, no
download) and a synthetic convex problem with a known optimum."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedswarm.tasks.base import ExampleSpec, Task, TaskData
from fedswarm.tasks.models import logistic, mlp, small_cnn


def split_train_test(x: torch.Tensor, y: torch.Tensor, seed: int, test_fraction: float,
                     num_classes: int, **meta) -> TaskData:
    """A seeded shuffle, then the last ``test_fraction`` of rows is the global test set."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[0], generator=g)
    n_test = max(1, int(round(test_fraction * x.shape[0])))
    tr, te = perm[:-n_test], perm[-n_test:]
    return TaskData(x[tr].contiguous(), y[tr].contiguous(), x[te].contiguous(), y[te].contiguous(),
                    num_classes, dict(meta))


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits: 1797 flattened 8x8 images (values 0..16) and labels.

    Read from the CSV that ships inside scikit-learn, found without importing scikit-learn:
    its import costs about 2 s of CPU, and a deployment pays that in every process that
    loads the task (Flower starts a ClientApp process for each message). A scikit-learn
    whose files are laid out otherwise is read with its own ``load_digits``.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits tasks need scikit-learn: pip install 'fedswarm[sim]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        raw = np.loadtxt(path, delimiter=",")
        return raw[:, :-1], raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data, d.target


# What a node's own digits look like (fedswarm client --data): an 8x8 grey image or its 64
# values as one row, on the model's scale [0, 1] (scikit-learn's 0..16 divided by 16; 8-bit
# pixels divided by 255).
DIGITS_ROWS = ExampleSpec(shape=(64,), num_classes=10, accepts=((64,), (8, 8), (1, 8, 8)), image_size=(8, 8))
DIGITS_IMAGES = ExampleSpec(shape=(1, 8, 8), num_classes=10, accepts=((64,), (8, 8), (1, 8, 8)), image_size=(8, 8))


def _digits(seed: int, test_fraction: float, image: bool) -> TaskData:
    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    if image:
        x = x.view(-1, 1, 8, 8)
    y = torch.tensor(target, dtype=torch.int64)
    return split_train_test(x, y, seed, test_fraction, 10, source="sklearn.datasets.load_digits")


# -- synthetic-logreg -----------------------------------------------------------------

LOGREG_DIM = 10
LOGREG_SAMPLES = 2000
LOGREG_L2 = 1e-2  # ridge weight: makes the optimum unique and strongly convex


def _logreg_data(seed: int, test_fraction: float) -> TaskData:
    # The data generator uses its own fixed seed: the problem is the same for every run
    # seed, so its optimum is a fixed point to check against.
    rng = np.random.default_rng(1234)
    w_true = rng.normal(size=LOGREG_DIM)
    x = rng.normal(size=(LOGREG_SAMPLES, LOGREG_DIM))
    p = 1.0 / (1.0 + np.exp(-(x @ w_true + 0.5)))
    y = (rng.random(LOGREG_SAMPLES) < p).astype(np.int64)
    return split_train_test(torch.tensor(x, dtype=torch.float32), torch.tensor(y), seed,
                            test_fraction, 2, w_true=w_true.tolist())


def logreg_objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean logistic loss plus (L2/2)·||θ||² over all parameters (weights and bias)."""
    logits = model(x).squeeze(-1)
    reg = sum((p * p).sum() for p in model.parameters())
    return F.binary_cross_entropy_with_logits(logits, y.float()) + 0.5 * LOGREG_L2 * reg


def logreg_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return ((model(x).squeeze(-1) > 0).long() == y).float().mean().item()


def logreg_optimum(x: np.ndarray, y: np.ndarray, iters: int = 50) -> np.ndarray:
    """The exact minimiser of :func:`logreg_objective` on (x, y) by Newton's method in
    float64, as ``[w_1..w_D, b]`` (the layout of ``nn.Linear(D, 1)``'s flat vector).
    An independent oracle: plain numpy, no torch."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    n, dim = x.shape
    xa = np.hstack([x, np.ones((n, 1))])
    theta = np.zeros(dim + 1)
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(xa @ theta)))
        grad = xa.T @ (p - y) / n + LOGREG_L2 * theta
        hess = (xa * (p * (1 - p))[:, None]).T @ xa / n + LOGREG_L2 * np.eye(dim + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-14:
            break
    return theta


BUILTIN_TASKS: dict[str, Task] = {
    "digits-mlp": Task(
        "digits-mlp",
        "scikit-learn digits (8x8 handwritten, 10 classes), 64-64-10 MLP",
        lambda: mlp(64, 10),
        lambda seed, tf: _digits(seed, tf, image=False),
        examples=DIGITS_ROWS,
    ),
    "digits-cnn": Task(
        "digits-cnn",
        "scikit-learn digits as 1x8x8 images, two-block CNN",
        lambda: small_cnn(1, 8, 10),
        lambda seed, tf: _digits(seed, tf, image=True),
        examples=DIGITS_IMAGES,
    ),
    "synthetic-logreg": Task(
        "synthetic-logreg",
        "synthetic L2-regularised logistic regression (10 features), exact optimum known",
        lambda: logistic(LOGREG_DIM),
        _logreg_data,
        objective=logreg_objective,
        accuracy=logreg_accuracy,
        extra={"optimum": logreg_optimum},
    ),
}
