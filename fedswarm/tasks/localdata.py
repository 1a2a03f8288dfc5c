"""A node's own dataset: read it from disk, check it against the task, split off validation.

Formats (what :func:`read_examples` accepts at ``path``):

- ``*.npz`` with arrays ``x`` (examples, first axis) and ``y`` (integer labels);
- ``*.csv`` (stdlib ``csv``, a header row) or ``*.parquet`` (pyarrow, imported only here): one
  label column (``label_column``, default ``label``), every other column a feature in order
  (or, in Parquet, one list column holding the whole example);
- a folder saved by Hugging Face ``datasets``' ``save_to_disk`` (``datasets`` imported only
  here): the label column plus an image column or feature columns (a DatasetDict: its ``train``);
- any other folder is an ImageFolder: one subfolder per class, named by the class number
  (``0``, ``1``, ...) or by one of the task's ``class_names``, image files inside.

The task's :class:`~fedswarm.tasks.base.ExampleSpec` says what an example must be. Values:
8-bit data (image files, ``uint8`` arrays) is divided by ``pixel_scale`` (255); anything else
must already be on the model's scale ``value_range`` (``[0, 1]`` for the digits tasks:
scikit-learn's 0..16 divided by 16) and is refused otherwise. Every problem is a
:class:`LocalDataError` whose message is one line naming the file and what is wrong; in an
ImageFolder an unreadable image is skipped and counted instead, as long as at most a tenth of
the images are.

The node's validation split is a seeded shuffle (the run seed) whose last ``val_fraction``
of examples is held out: the same split every round and on every engine.
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedswarm.tasks.base import ExampleSpec, Task

__all__ = ["LocalDataError", "LocalDataSpec", "LocalSplit", "read_examples", "split_local", "load_local",
           "examples_of", "client_datasets", "MAX_SKIPPED_FRACTION"]

MAX_SKIPPED_FRACTION = 0.1  # an ImageFolder with more bad images than this is refused, not skipped
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_FILE_FORMATS = (".npz", ".csv", ".parquet", ".pq")


class LocalDataError(ValueError):
    """A node's data cannot be used; the message is one line naming the file and the problem."""


@dataclass(frozen=True)
class LocalDataSpec:
    """Where a node's own data is and how to split it: ``fedswarm client --data PATH
    --label-column C --val-fraction F`` (node config ``data-path``, ``label-column``,
    ``val-fraction``) or one entry of ``fedswarm sim --client-data DIR``."""

    path: str
    label_column: str = "label"
    val_fraction: float = 0.2


@dataclass
class LocalSplit:
    """A node's examples after the seeded split; ``skipped`` counts unreadable examples left out."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    skipped: int


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _optional(module: str, package: str, what: str, where: Path):
    """Import ``module`` (an optional package a lean device may lack), or one clear line."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise LocalDataError(f"{where}: reading {what} needs the {package} package (pip install {package})") from None


def examples_of(task: Task) -> ExampleSpec:
    if task.examples is None:
        raise LocalDataError(f"task '{task.name}' does not say what its examples look like (no ExampleSpec), "
                             "so it cannot train on a node's own data")
    return task.examples


def _check(x: np.ndarray, y: np.ndarray, spec: ExampleSpec, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw arrays -> (x float32 [N, *spec.shape], y int64 [N]), or one clear line."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 0 or x.shape[0] == 0:
        raise LocalDataError(f"{where}: holds no examples")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise LocalDataError(f"{where}: {x.shape[0]} examples but labels of shape {tuple(y.shape)}")
    shape = tuple(int(s) for s in x.shape[1:])
    accepted = (spec.shape, *spec.accepts)
    if shape not in accepted:
        allowed = " or ".join(str(s) for s in dict.fromkeys(accepted))
        raise LocalDataError(f"{where}: examples have shape {shape}, the task takes {allowed}")
    if x.dtype == np.uint8:
        xf = x.astype(np.float32) / np.float32(spec.pixel_scale)
    elif x.dtype.kind in "fiu" and x.dtype.kind != "c":
        xf = x.astype(np.float32)
    else:
        raise LocalDataError(f"{where}: examples have dtype {x.dtype}; numbers are needed")
    flat = xf.reshape(xf.shape[0], -1)
    bad = ~np.isfinite(flat).all(axis=1)
    if bad.any():
        raise LocalDataError(f"{where}: example {int(np.argmax(bad))} has a value that is not finite")
    lo, hi = spec.value_range
    out = ((flat < lo) | (flat > hi)).any(axis=1)
    if out.any():
        i = int(np.argmax(out))
        raise LocalDataError(
            f"{where}: example {i} has values in [{flat[i].min():g}, {flat[i].max():g}], outside the task's "
            f"[{lo:g}, {hi:g}] (scale them first, e.g. digits 0..16 / 16, or store 8-bit pixels as uint8)")
    if y.dtype.kind not in "iu":
        if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise LocalDataError(f"{where}: labels have dtype {y.dtype}; integer class numbers are needed")
    wrong = (y < 0) | (y >= spec.num_classes)
    if wrong.any():
        i = int(np.argmax(wrong))
        raise LocalDataError(f"{where}: label {int(y[i])} of example {i} is outside the task's classes "
                             f"0..{spec.num_classes - 1}")
    xt = torch.from_numpy(np.ascontiguousarray(xf)).reshape(-1, *spec.shape)
    return xt, torch.from_numpy(y.astype(np.int64))


def _image_array(img, spec: ExampleSpec) -> np.ndarray:
    """One Pillow image -> uint8 array in the task's mode and size (ValueError: why not)."""
    if spec.image_size is None:
        raise ValueError("the task takes no images")
    img = img.convert(spec.image_mode)
    h, w = spec.image_size
    if img.size != (w, h):
        raise ValueError(f"image is {img.size[0]}x{img.size[1]}, the task takes {w}x{h}")
    return np.asarray(img, dtype=np.uint8)


def _class_of(name: str, spec: ExampleSpec) -> int | None:
    if name in spec.class_names:
        return spec.class_names.index(name)
    if name.isdigit() and int(name) < spec.num_classes:
        return int(name)
    return None


def _read_image_folder(root: Path, spec: ExampleSpec) -> tuple[np.ndarray, np.ndarray, int]:
    if spec.image_size is None:
        raise LocalDataError(f"{root}: an image folder, but the task takes no images")
    image = _optional("PIL.Image", "pillow", "images", root)
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    images, labels, bad = [], [], []
    for folder in classes:
        label = _class_of(folder.name, spec)
        if label is None:
            raise LocalDataError(f"{folder}: folder name is not a class of the task (0..{spec.num_classes - 1}"
                                 + (f" or {', '.join(spec.class_names)}" if spec.class_names else "") + ")")
        for f in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
            try:
                with image.open(f) as img:
                    img.load()
                    images.append(_image_array(img, spec))
                labels.append(label)
            except Exception as exc:  # noqa: BLE001 - any unreadable image is skipped and counted
                bad.append(f"{f}: {_one_line(exc)}")
    total = len(images) + len(bad)
    if total == 0:
        raise LocalDataError(f"{root}: holds no examples (an ImageFolder needs one subfolder per class, "
                             "images inside)")
    if not images or len(bad) > MAX_SKIPPED_FRACTION * total:
        raise LocalDataError(f"{root}: {len(bad)} of {total} images cannot be used (first: {bad[0]})")
    return np.stack(images), np.asarray(labels, dtype=np.int64), len(bad)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise LocalDataError(f"{path}: no array {' or '.join(missing)} (an .npz needs arrays x and y; "
                                     f"it has {', '.join(z.files) or 'none'})")
            return z["x"], z["y"]
    except LocalDataError:
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile, pickle and format errors all mean the same
        raise LocalDataError(f"{path}: cannot read as .npz ({_one_line(exc)})") from None


def _read_csv(path: Path, label_column: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error, OSError) as exc:
        raise LocalDataError(f"{path}: cannot read as CSV ({_one_line(exc)})") from None
    if not rows:
        raise LocalDataError(f"{path}: holds no examples (empty file)")
    header = [h.strip() for h in rows[0]]
    if label_column not in header:
        raise LocalDataError(f"{path}: no label column '{label_column}' (columns: {', '.join(header)}; "
                             "choose it with --label-column)")
    li = header.index(label_column)
    width = len(header)
    values = np.empty((len(rows) - 1, width), dtype=np.float64)
    for n, row in enumerate(rows[1:]):
        if len(row) != width:
            raise LocalDataError(f"{path}: line {n + 2} has {len(row)} fields, the header {width}")
        for j, v in enumerate(row):
            try:
                values[n, j] = float(v)
            except ValueError:
                raise LocalDataError(f"{path}: line {n + 2}: '{v}' in column '{header[j]}' is not a number") from None
    return np.delete(values, li, axis=1), values[:, li]


def _table_arrays(columns: dict[str, list], label_column: str, where: str, spec: ExampleSpec,
                  images: set[str] = frozenset()) -> tuple[np.ndarray, np.ndarray, int]:
    """A table's columns -> (x, y): one image or list column, or every other column a feature."""
    if label_column not in columns:
        raise LocalDataError(f"{where}: no label column '{label_column}' (columns: {', '.join(columns)}; "
                             "choose it with --label-column)")
    y = np.asarray(columns[label_column])
    rest = [c for c in columns if c != label_column]
    if len(rest) == 1 and rest[0] in images:
        arrays = []
        for i, img in enumerate(columns[rest[0]]):
            try:
                arrays.append(_image_array(img, spec))
            except Exception as exc:  # noqa: BLE001
                raise LocalDataError(f"{where}: image {i}: {_one_line(exc)}") from None
        return np.stack(arrays) if arrays else np.empty((0,)), y, 0
    try:
        if len(rest) == 1:
            x = np.asarray(columns[rest[0]], dtype=np.float64 if not _is_uint8(columns[rest[0]]) else np.uint8)
        else:
            x = np.stack([np.asarray(columns[c], dtype=np.float64) for c in rest], axis=1) if rest else np.empty((0,))
    except (ValueError, TypeError) as exc:
        raise LocalDataError(f"{where}: feature columns are not all numbers ({_one_line(exc)})") from None
    return x, y, 0


def _is_uint8(values) -> bool:
    return isinstance(values, np.ndarray) and values.dtype == np.uint8


def _read_parquet(path: Path, label_column: str, spec: ExampleSpec) -> tuple[np.ndarray, np.ndarray, int]:
    pq = _optional("pyarrow.parquet", "pyarrow", "Parquet", path)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise LocalDataError(f"{path}: cannot read as Parquet ({_one_line(exc)})") from None
    return _table_arrays(table.to_pydict(), label_column, str(path), spec)


def _read_hf(path: Path, label_column: str, spec: ExampleSpec) -> tuple[np.ndarray, np.ndarray, int]:
    datasets = _optional("datasets", "datasets", "a saved Hugging Face dataset", path)
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise LocalDataError(f"{path}: cannot read as a saved Hugging Face dataset ({_one_line(exc)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise LocalDataError(f"{path}: a DatasetDict without a 'train' split (it has {', '.join(ds)})")
        ds = ds["train"]
    images = {name for name, feat in ds.features.items() if isinstance(feat, datasets.Image)}
    columns = {name: (ds[name] if name in images else ds.with_format("numpy")[name]) for name in ds.column_names}
    return _table_arrays(columns, label_column, str(path), spec, images)


def read_examples(path: str | Path, spec: ExampleSpec, label_column: str = "label"
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """All examples at ``path`` as ``(x [N, *spec.shape] float32, y [N] int64, skipped)``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LocalDataError(f"{p}: no such file or folder")
    skipped = 0
    if spec.reader is not None:
        try:
            x, y = spec.reader(p, label_column)
        except LocalDataError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's reader: its failure in one line
            raise LocalDataError(f"{p}: the task's reader failed ({_one_line(exc)})") from None
    elif p.is_dir():
        if any((p / m).is_file() for m in _HF_MARKERS):
            x, y, skipped = _read_hf(p, label_column, spec)
        else:
            x, y, skipped = _read_image_folder(p, spec)
    elif p.suffix.lower() == ".npz":
        x, y = _read_npz(p)
    elif p.suffix.lower() == ".csv":
        x, y = _read_csv(p, label_column)
    elif p.suffix.lower() in (".parquet", ".pq"):
        x, y, skipped = _read_parquet(p, label_column, spec)
    else:
        raise LocalDataError(f"{p}: unknown format (an .npz, .csv or .parquet file, an ImageFolder, or a "
                             "folder saved by datasets' save_to_disk)")
    xt, yt = _check(x, y, spec, str(p))
    return xt, yt, skipped


def split_local(n: int, val_fraction: float, seed: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices) of ``n`` examples: a shuffle seeded by ``seed``,
    the last ``round(val_fraction * n)`` held out."""
    if not 0.0 <= val_fraction < 1.0:
        raise LocalDataError(f"{where}: --val-fraction must be in [0, 1) (got {val_fraction})")
    n_val = int(round(val_fraction * n))
    if val_fraction > 0 and n_val == 0:
        raise LocalDataError(f"{where}: {n} examples leave an empty validation split at --val-fraction "
                             f"{val_fraction:g} (need at least {math.ceil(0.5 / val_fraction)} examples)")
    if n - n_val < 1:
        raise LocalDataError(f"{where}: {n} examples leave no training examples at --val-fraction {val_fraction:g}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[: n - n_val], perm[n - n_val :]


@functools.lru_cache(maxsize=64)
def _load_local(task_name: str, local: LocalDataSpec, seed: int) -> LocalSplit:
    from fedswarm.tasks import get_task

    x, y, skipped = read_examples(local.path, examples_of(get_task(task_name)), local.label_column)
    tr, va = split_local(int(x.shape[0]), local.val_fraction, seed, local.path)
    return LocalSplit(x[tr].contiguous(), y[tr].contiguous(), x[va].contiguous(), y[va].contiguous(), skipped)


def load_local(task_name: str, local: LocalDataSpec, seed: int) -> LocalSplit:
    """A node's own data for ``task_name``, split with ``seed`` (cached per process)."""
    return _load_local(task_name, local, seed)


def client_datasets(folder: str | Path) -> list[Path]:
    """The datasets of ``fedswarm sim --client-data DIR``: its entries sorted by name (hidden
    ones left out), client ``k`` the ``k``-th; each a dataset file or folder."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise LocalDataError(f"{root}: --client-data must be a folder holding one dataset per client")
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    if not entries:
        raise LocalDataError(f"{root}: holds no client datasets")
    for p in entries:
        if p.is_file() and p.suffix.lower() not in _FILE_FORMATS:
            raise LocalDataError(f"{p}: not a dataset (a client's data is an .npz, .csv or .parquet file or a folder)")
    return [p.resolve() for p in entries]
