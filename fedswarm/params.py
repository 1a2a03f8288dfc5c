"""Flat parameter vectors and their layouts.

A model's trainable state is one flat float32 vector of length ``d``. A
:class:`ParamLayout` records, for every tensor, its name, shape and offset in
that vector, so codecs, mixing and aggregation can work on vectors (with a
leading client axis, ``[K, d]``) and still ask for per-layer views: per-column
scales for 1-bit SGD, variable subsets for PVT, stages for ProgFed.

Only trainable parameters are in the vector; buffers (e.g. BatchNorm running
statistics) are not communicated by any strategy here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["TensorSpec", "ParamLayout", "all_finite", "get_flat", "set_flat"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in the flat vector: ``vec[offset : offset + numel]``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def is_matrix(self) -> bool:
        """True for tensors with at least two dims (weights), viewed as ``[rows, cols]``."""
        return len(self.shape) >= 2

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` when the tensor is seen as a matrix whose columns are the
        trailing dims flattened: a Linear ``[out, in]`` stays as is, a Conv
        ``[out, in, kh, kw]`` becomes ``[out, in*kh*kw]``; a vector is one column."""
        if not self.shape:
            return (1, 1)
        if len(self.shape) == 1:
            return (self.shape[0], 1)
        rows = self.shape[0]
        return (rows, self.numel // rows)


class ParamLayout:
    """Names, shapes and offsets of a model's trainable tensors in a flat vector."""

    def __init__(self, specs: Sequence[TensorSpec]):
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        offset = 0
        for s in self.specs:
            if s.offset != offset:
                raise ValueError(f"tensor {s.name!r} starts at {s.offset}, expected {offset}")
            offset = s.end
        self.d = offset
        self._by_name = {s.name: s for s in self.specs}

    @classmethod
    def from_shapes(cls, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> "ParamLayout":
        specs, offset = [], 0
        for name, shape in shapes:
            spec = TensorSpec(name, tuple(int(n) for n in shape), offset)
            specs.append(spec)
            offset = spec.end
        return cls(specs)

    @classmethod
    def from_module(cls, model: nn.Module) -> "ParamLayout":
        return cls.from_shapes(
            [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
        )

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.specs)

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParamLayout) and self.specs == other.specs

    def __repr__(self) -> str:
        return f"ParamLayout(d={self.d}, tensors={len(self.specs)})"

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    # -- views -------------------------------------------------------------------------
    def view(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor ``name`` inside ``x`` (``[d]`` or ``[K, d]``), shaped as the parameter
        (with the leading client axis kept). A view, not a copy."""
        s = self._by_name[name]
        if x.dim() == 1:
            return x[s.offset : s.end].view(s.shape)
        return x[:, s.offset : s.end].view(x.shape[0], *s.shape)

    def split(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor of ``x`` as a view, by name."""
        return {s.name: self.view(x, s.name) for s in self.specs}

    def coords(self, ids: Sequence[int] | torch.Tensor) -> list[slice]:
        """The flat coordinates of the tensors at positions ``ids`` of the layout, one slice
        each, in the order given (PVT's trained variables). Slices, not an index: indexing by
        a ``[d]`` mask builds an int64 index twice the size of the values."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return [slice(self.specs[i].offset, self.specs[i].end) for i in ids]

    def take(self, x: torch.Tensor, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The :meth:`coords` of ``ids`` in ``x`` (``[d]`` or ``[K, d]``), concatenated (a copy)."""
        return torch.cat([x[..., sl] for sl in self.coords(ids)], dim=-1)

    def mask(self, names: Sequence[str], device: torch.device | str = "cpu") -> torch.Tensor:
        """A boolean ``[d]`` mask selecting the given tensors."""
        m = torch.zeros(self.d, dtype=torch.bool, device=device)
        for n in names:
            s = self._by_name[n]
            m[s.offset : s.end] = True
        return m

    # -- serialization (for Flower ConfigRecords and the run store) ---------------------
    def to_dict(self) -> dict:
        return {"names": self.names, "shapes": [list(s.shape) for s in self.specs]}

    @classmethod
    def from_dict(cls, data: dict) -> "ParamLayout":
        return cls.from_shapes(list(zip(data["names"], [tuple(s) for s in data["shapes"]])))


def get_flat(model: nn.Module) -> torch.Tensor:
    """The model's trainable parameters as one detached float32 vector (a copy)."""
    params = [p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]
    if not params:
        return torch.zeros(0)
    return torch.cat(params).to(torch.float32)


@torch.no_grad()
def set_flat(model: nn.Module, vec: torch.Tensor) -> None:
    """Load a flat vector into the model's trainable parameters, in place."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    if vec.dim() != 1 or vec.numel() != total:
        raise ValueError(f"flat vector has shape {tuple(vec.shape)}, model needs [{total}]")
    # Copy, never alias: vector_to_parameters would make the parameters views of ``vec``,
    # and training would then write into the caller's vector.
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(vec[offset : offset + n].view_as(p))
        offset += n


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite, without a bool tensor (``isfinite().all()``
    materializes one and is ~20x slower on a CPU).

    First the sum: a NaN or an infinity absorbs every IEEE addition (``inf + x = inf``,
    ``inf - inf = NaN``, ``NaN + x = NaN``), in any order and any split across threads or
    vector lanes, so a finite sum proves every value finite (one add per value, about half
    the time of a min and a max). A sum that is not finite may also be finite values that
    overflowed; only then does the exact test run: one ``aminmax`` (NaN propagates through
    min and max)."""
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
