"""A peer's checkpoint: model, algorithm state and round, written atomically every round.

``save`` writes a temporary file in the same directory, fsyncs it and renames it over the
old checkpoint (``os.replace`` is atomic on POSIX), so a peer killed at any instant leaves
either the previous or the new checkpoint, never half of one. ``load`` returns None when
there is none. Tensors go through ``torch.save``; everything else must be plain data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_FILE", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FILE = "checkpoint.pt"


def save_checkpoint(state_dir: str | os.PathLike, data: dict[str, Any], *, fsync: bool = True) -> Path:
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / CHECKPOINT_FILE
    tmp = d / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(data, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(state_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(state_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
