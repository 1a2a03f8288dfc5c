"""Image-classification tasks from the Hugging Face hub, loaded through flwr-datasets.

For users with the network: ``mnist``, ``cifar10`` and ``femnist``. Nothing is
downloaded at import time or in tests; the tests run this same code on a
``datasets.Dataset`` built locally (written to parquet and read back through
``flwr_datasets.FederatedDataset(dataset="parquet", data_files=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedswarm.tasks.base import Task, TaskData
from fedswarm.tasks.builtin import split_train_test
from fedswarm.tasks.models import small_cnn

__all__ = ["HFImageSpec", "HF_TASKS", "load_hf_images", "hf_task"]


@dataclass(frozen=True)
class HFImageSpec:
    dataset: str  # hub name, or a builder such as "parquet" with data_files
    image_key: str
    label_key: str
    channels: int
    side: int
    num_classes: int


HF_SPECS = {
    "mnist": HFImageSpec("ylecun/mnist", "image", "label", 1, 28, 10),
    "cifar10": HFImageSpec("uoft-cs/cifar10", "img", "label", 3, 32, 10),
    "femnist": HFImageSpec("flwrlabs/femnist", "image", "character", 1, 28, 62),
}


def images_to_tensor(images: list[Any], channels: int) -> torch.Tensor:
    """PIL images or arrays -> float32 ``[N, C, H, W]`` in [0, 1]."""
    arrs = []
    for img in images:
        if hasattr(img, "convert"):
            img = img.convert("L" if channels == 1 else "RGB")
        a = np.asarray(img, dtype=np.float32)
        if a.ndim == 2:
            a = a[None]
        else:
            a = a.transpose(2, 0, 1)
        arrs.append(a)
    x = torch.from_numpy(np.stack(arrs))
    return x / 255.0 if x.max() > 1.0 else x


def load_hf_images(spec: HFImageSpec, seed: int, test_fraction: float, **load_kwargs: Any) -> TaskData:
    """Load every split of ``spec.dataset`` through flwr-datasets and pool it; the global
    test set is then carved out with the task seed, like the built-in tasks."""
    try:
        from flwr_datasets import FederatedDataset
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError("Hugging Face tasks need flwr-datasets: pip install 'fedswarm[sim]'") from exc
    fds = FederatedDataset(dataset=spec.dataset, partitioners={"train": 1}, shuffle=False, **load_kwargs)
    xs, ys = [], []
    for split in fds._dataset.keys() if getattr(fds, "_dataset", None) is not None else ["train"]:
        ds = fds.load_split(split)
        for col in (spec.image_key, spec.label_key):
            if col not in ds.column_names:
                raise ValueError(f"dataset {spec.dataset!r} split {split!r} has no column {col!r} "
                                 f"(columns: {ds.column_names})")
        xs.append(images_to_tensor(ds[spec.image_key], spec.channels))
        ys.append(torch.tensor(ds[spec.label_key], dtype=torch.int64))
    x, y = torch.cat(xs), torch.cat(ys)
    if tuple(x.shape[1:]) != (spec.channels, spec.side, spec.side):
        raise ValueError(f"dataset {spec.dataset!r} gives images of shape {tuple(x.shape[1:])}, "
                         f"expected {(spec.channels, spec.side, spec.side)}")
    return split_train_test(x, y, seed, test_fraction, spec.num_classes, source=spec.dataset)


def hf_task(name: str, spec: HFImageSpec, **load_kwargs: Any) -> Task:
    return Task(
        name,
        f"{spec.dataset} from the Hugging Face hub via flwr-datasets (needs the network), small CNN",
        lambda: small_cnn(spec.channels, spec.side, spec.num_classes, width=32),
        lambda seed, tf: load_hf_images(spec, seed, tf, **load_kwargs),
    )


HF_TASKS: dict[str, Task] = {name: hf_task(name, spec) for name, spec in HF_SPECS.items()}
