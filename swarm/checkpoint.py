"""A peer's checkpoint: model, algorithm state and round, written atomically every round.

``save`` writes a temporary file in the same directory, fsyncs it and renames it over the
old checkpoint (``os.replace`` is atomic on POSIX), so a peer killed at any instant leaves
either the previous or the new checkpoint, never half of one. ``load`` returns None when
there is none, and :class:`CheckpointError` when it cannot be used. Tensors go through
``torch.save``; everything else must be plain data: it is read with
``torch.load(weights_only=True)`` and no globals beyond PyTorch's own, so a file that names any
other callable (``os.system`` through ``__reduce__``, say) is refused before anything is called.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_FILE", "CheckpointError", "load_checkpoint", "save_checkpoint"]

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


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read back (truncated, altered, not a peer's checkpoint)."""


def load_checkpoint(state_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The peer's checkpoint in ``state_dir`` (None when there is none); :class:`CheckpointError`
    naming the file and why when it cannot be used: it must be a dict with a non-negative int
    ``round``, a ``history`` list, a ``driver`` state dict and (if present) an int ``restarts``."""
    path = Path(state_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated or altered: the zip reader and the unpickler raise many types
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"{path} holds a {type(ck).__name__}, not a peer's checkpoint")
    checks = {"round": lambda v: type(v) is int and v >= 0, "history": lambda v: isinstance(v, list),
              "driver": lambda v: isinstance(v, dict), "restarts": lambda v: type(v) is int and v >= 0}
    for key, ok in checks.items():
        if (key in ck or key != "restarts") and not ok(ck.get(key)):
            raise CheckpointError(f"{path}: '{key}' is missing or malformed ({type(ck.get(key)).__name__})")
    return ck
