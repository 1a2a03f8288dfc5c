"""The server's checkpoint: everything a run needs to go on after round R, kept in the store.

After every ``checkpoint_every``-th recorded round (``--checkpoint-every K``, default 1) and after a
control changed the run, :class:`ServerCheckpointer` serializes

- the global model (the ArrayRecord the next round starts from),
- the strategy's state (:mod:`fedswarm.strategies.resumable`: optimizer and momentum,
  error-feedback residuals, replica-sync bookkeeping, HL's policy, ProgFed's stage, the DP
  accountant, a robust or coded strategy's state),
- the process's random states (Flower samples nodes with ``random``),
- the per-device-class policies in force, and the attack's state of a ``--byzantine`` run,
- what the engine can give of the clients' own state (the in-process engine: every
  virtual node's ``Context.state``, so residuals and replicas come back too),

and commits it with :meth:`fedswarm.store.Store.save_checkpoint`: one transaction, so a
process killed at any instant leaves the previous checkpoint or the new one.

A checkpoint is read with ``torch.load(weights_only=True)`` and an explicit allowlist
(:data:`SAFE_GLOBALS`): besides what PyTorch allows (tensors, plain containers), only the
fedswarm, Flower, NumPy and ``random`` types that strategies' states hold may be named in it,
so a checkpoint written into the store by someone else cannot run code in the process that
resumes the run (a pickle that calls ``os.system`` is refused, naming the callable, before
anything is called). The file format is unchanged: checkpoints written by earlier releases
(``torch.save`` of the same dict) load as they are. PyTorch's restricted unpickler keeps its
memo in a dict, so a pickle naming a huge memo index allocates nothing for it.
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedswarm.errors import CheckpointError
from fedswarm.store import Store
from fedswarm.strategies.resumable import rng_state, strategy_state

__all__ = ["CHECKPOINT_FORMAT", "SAFE_GLOBALS", "ServerCheckpoint", "ServerCheckpointer", "dumps", "loads",
           "load_latest", "safe_globals"]

log = logging.getLogger("fedswarm.server")

CHECKPOINT_FORMAT = 1
#: The globals (beyond PyTorch's own weights-only set) a checkpoint may name: every type the
#: strategies' states, the engine's client state and the RNG states hold, across all registered
#: strategies (``torch.serialization.get_unsafe_globals_in_checkpoint`` of each one's checkpoint
#: lists them; tests/test_resume.py resumes them). NumPy's own names are given for NumPy 2
#: (``numpy._core``) and NumPy 1 (``numpy.core``) writers; both resolve to NumPy 2's objects.
#: A name here is pickled by its module path: a class that moves must keep its old name here.
SAFE_GLOBALS = (
    "builtins.bytes",
    "random.Random",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy._core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar",
    "numpy.random._pcg64.PCG64",
    "numpy.random._pickle.__bit_generator_ctor",
    "numpy.random._pickle.__generator_ctor",
    "numpy.random.bit_generator.SeedSequence",
    "numpy.random.bit_generator.__pyx_unpickle_SeedSequence",
    "flwr.app.message.array.Array",
    "flwr.app.message.arrayrecord.ArrayRecord",
    "flwr.app.message.arrayrecord._check_key",
    "flwr.app.message.arrayrecord._check_value",
    "flwr.app.message.configrecord.ConfigRecord",
    "flwr.app.message.configrecord._check_key",
    "flwr.app.message.configrecord._check_value",
    "flwr.app.message.metricrecord.MetricRecord",
    "flwr.app.message.metricrecord._check_key",
    "flwr.app.message.metricrecord._check_value",
    "fedswarm.payload.Payload",
    "fedswarm.algorithms.compression.error_feedback.ErrorFeedbackState",
    "fedswarm.algorithms.selection.hl.NodeStates",
    "fedswarm.algorithms.selection.hl.QAgent",
    "fedswarm.strategies.federated.compressed_sync.ReplicaSync",
)
_ALIASES = {"numpy.core.multiarray._reconstruct": "numpy._core.multiarray._reconstruct",
            "numpy.core.multiarray.scalar": "numpy._core.multiarray.scalar"}
_UNSAFE = re.compile(r"GLOBAL ([\w.]+)")  # how PyTorch's refusals name a global it does not allow
#: Checkpoints kept per run (the newest, and the one before in case the newest is unreadable).
KEEP = 2


@dataclass
class ServerCheckpoint:
    """A run's state after ``round`` (what :meth:`ServerCheckpointer.save` wrote)."""

    round: int
    arrays: ArrayRecord
    strategy: dict[str, Any]
    rng: dict[str, Any]
    policies: dict[str, dict[str, Any]]
    grid: dict[str, Any] | None  # the engine's client state, when it has any to give
    byzantine: dict[str, Any] | None
    strategy_name: str


def _arrays_to_plain(arrays: ArrayRecord) -> list[tuple[str, np.ndarray]]:
    return [(k, np.array(arrays[k].numpy(), copy=True)) for k in arrays.keys()]


def _arrays_from_plain(items: list[tuple[str, np.ndarray]]) -> ArrayRecord:
    rec = ArrayRecord()
    for k, v in items:
        rec[k] = Array(np.ascontiguousarray(v))
    return rec


def dumps(ck: ServerCheckpoint) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, "round": ck.round, "arrays": _arrays_to_plain(ck.arrays),
                "strategy": ck.strategy, "rng": ck.rng, "policies": ck.policies, "grid": ck.grid,
                "byzantine": ck.byzantine, "strategy_name": ck.strategy_name}, buf)
    return buf.getvalue()


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


_allowed: list[tuple[Any, str]] = []


def safe_globals() -> list[tuple[Any, str]]:
    """:data:`SAFE_GLOBALS` (and their NumPy 1 names) as ``(object, name)`` pairs for
    ``torch.serialization.safe_globals``; resolved once (an unknown name is a bug: it raises)."""
    if not _allowed:
        import numpy.dtypes

        # np.dtype(...) unpickles into its concrete class (Float32DType...), which must be allowed to build
        dtypes = [(cls, f"numpy.dtypes.{name}") for name, cls in vars(numpy.dtypes).items()
                  if name.endswith("DType") and isinstance(cls, type)]
        _allowed.extend([(_resolve(n), n) for n in SAFE_GLOBALS] + dtypes +
                        [(_resolve(target), alias) for alias, target in _ALIASES.items()])
    return _allowed


def loads(data: bytes) -> ServerCheckpoint:
    """The checkpoint in ``data``; :class:`CheckpointError` in one line when it cannot be read or
    names a callable outside :data:`SAFE_GLOBALS` (refused before anything in it is called)."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            raw = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        unsafe = _UNSAFE.search(str(exc))
        if unsafe:
            raise CheckpointError(f"the checkpoint names {unsafe.group(1)}, which no fedswarm checkpoint holds: "
                                  f"refused without running it (was the store written by someone else?)") from None
        raise CheckpointError(f"the checkpoint cannot be read (UnpicklingError: {_why(exc)})") from None
    except Exception as exc:  # a truncated or foreign blob: say what it is, not a pickle trace
        raise CheckpointError(f"the checkpoint cannot be read ({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(raw, dict) or raw.get("format") != CHECKPOINT_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"checkpoint format {got!r}, this fedswarm reads format {CHECKPOINT_FORMAT}")
    for key, ok in _FIELDS.items():
        if key not in raw or not ok(raw[key]):
            raise CheckpointError(f"the checkpoint's '{key}' is missing or malformed ({type(raw.get(key)).__name__})")
    try:
        arrays = _arrays_from_plain(raw["arrays"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint's model arrays cannot be read ({exc})") from None
    return ServerCheckpoint(round=raw["round"], arrays=arrays, strategy=raw["strategy"], rng=raw["rng"],
                            policies=raw["policies"], grid=raw["grid"], byzantine=raw["byzantine"],
                            strategy_name=raw["strategy_name"])


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _why(exc: BaseException) -> str:
    """What PyTorch's weights-only unpickler objected to, without the advice around it."""
    lines = [line.strip().removeprefix("WeightsUnpickler error:").strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and not line.startswith(_BOILERPLATE)]
    return lines[0][:300] if lines else _first_line(exc)


def _named_arrays(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                                       and isinstance(item[1], np.ndarray) for item in v)


#: What :func:`loads` needs of each field (:func:`dumps` writes them so).
_FIELDS = {"round": lambda v: type(v) is int and v >= 0, "arrays": _named_arrays,
           "strategy": lambda v: isinstance(v, dict), "rng": lambda v: isinstance(v, dict),
           "policies": lambda v: isinstance(v, dict), "grid": lambda v: v is None or isinstance(v, dict),
           "byzantine": lambda v: v is None or isinstance(v, dict), "strategy_name": lambda v: isinstance(v, str)}


def load_latest(store: Store, run_id: str) -> ServerCheckpoint:
    """The run's newest checkpoint; :class:`CheckpointError` naming why there is none."""
    if store.get_run(run_id) is None:
        raise CheckpointError(f"no run '{run_id}' in {store.url}")
    found = store.checkpoint_data(run_id)
    if found is None:
        raise CheckpointError(f"run '{run_id}' has no checkpoint in {store.url} (it stopped before its first "
                              f"round was recorded, or was recorded by a runtime that does not checkpoint)")
    rnd, data = found
    ck = loads(data)
    if ck.round != rnd:
        raise CheckpointError(f"checkpoint row of round {rnd} holds round {ck.round}")
    return ck


class ServerCheckpointer:
    """Writes the run's checkpoint after a recorded round (the recorder decides which: every K-th).

    ``grid_state`` is the engine's ``state_dict`` (clients' state), or None; ``byzantine``
    the ``--byzantine`` grid, whose attack randomness must continue too."""

    def __init__(self, store: Store, run_id: str, strategy: Any, strategy_name: str, policies: Any, *,
                 grid_state: Any = None, byzantine: Any = None, keep: int = KEEP):
        self.store, self.run_id = store, run_id
        self.strategy, self.strategy_name = strategy, strategy_name
        self.policies = policies
        self.grid_state = grid_state
        self.byzantine = byzantine
        self.keep = keep
        strategy_state(strategy)  # a strategy that cannot be checkpointed fails now, not after round 1

    def save(self, rnd: int, arrays: ArrayRecord) -> int:
        """Checkpoint the run after round ``rnd``; the checkpoint's size in bytes."""
        ck = ServerCheckpoint(
            round=int(rnd), arrays=arrays, strategy=strategy_state(self.strategy), rng=rng_state(),
            policies=self.policies.as_dict(), grid=self.grid_state() if self.grid_state is not None else None,
            byzantine=self.byzantine.state_dict() if self.byzantine is not None else None,
            strategy_name=self.strategy_name)
        data = dumps(ck)
        self.store.save_checkpoint(self.run_id, int(rnd), data, keep=self.keep)
        return len(data)
