"""Node-local datasets made from scikit-learn's digits, in each format ``--data`` reads, with
the tensors each must give (the oracle: digits / 16, or an 8-bit pixel / 255)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from fedswarm.tasks.builtin import digits_arrays


def digits(rows: slice | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Digits ``rows`` as (x [N, 64] float32 in [0, 1], y [N] int64)."""
    data, target = digits_arrays()
    return (data[rows] / 16.0).astype(np.float32), target[rows].astype(np.int64)


def pixels(x: np.ndarray) -> np.ndarray:
    """[0, 1] values as 8-bit pixels (what an image file of them holds)."""
    return np.round(x * 255.0).astype(np.uint8)


def write_npz(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, x=x, y=y)
    return path


def write_image_folder(root: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """One subfolder per class (its number), one 8x8 grey PNG per example, named so that the
    reader's order (class, then file name) is easy to rebuild: see :func:`image_folder_order`."""
    from PIL import Image

    for i, (row, label) in enumerate(zip(pixels(x), y)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(row.reshape(8, 8), mode="L").save(folder / f"{i:05d}.png")
    return root


def image_folder_order(y: np.ndarray) -> np.ndarray:
    """The order an ImageFolder written by :func:`write_image_folder` is read in."""
    return np.lexsort((np.arange(len(y)), y))


def write_csv(path: Path, x: np.ndarray, y: np.ndarray, label_column: str = "label") -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"p{j}" for j in range(x.shape[1])] + [label_column])
        for row, label in zip(x, y):
            w.writerow([repr(float(v)) for v in row] + [int(label)])
    return path


def write_parquet(path: Path, x: np.ndarray, y: np.ndarray, label_column: str = "label") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {f"p{j}": pa.array(x[:, j]) for j in range(x.shape[1])}
    cols[label_column] = pa.array(y)
    pq.write_table(pa.table(cols), path)
    return path
