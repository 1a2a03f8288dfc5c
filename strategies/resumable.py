"""Checkpointing a strategy: the ``state_dict`` / ``load_state_dict`` protocol.

After every round fedswarm's ServerApp (:mod:`fedswarm.server.checkpoint`) saves what a
strategy needs to go on exactly where it stopped: its server-side optimizer and momentum,
error-feedback residuals, replica-sync bookkeeping, HL's policy, ProgFed's stage and heads,
the DP accountant, a coded strategy's decoder randomness... Every strategy the registry
builds implements, like PyTorch's modules and optimizers:

``state_dict() -> dict``
    What changes from round to round (never the hyperparameters: a resumed run builds
    the strategy again from the same run config, then loads this into it). The values are
    copies, so the strategy may go on running after the snapshot.
``load_state_dict(state)``
    Puts that state back into a freshly built strategy of the same class and config.
    Missing or unexpected keys raise :class:`StateError` naming them.

Optionally ``resync_clients()``: called on resume when the clients' own state (replicas,
residuals) could not be restored with the server's (a real device restarted, an engine that
keeps no client state); the strategy then brings every client back in step by protocol (the
full model next round) instead of trusting state that may be gone.

Most strategies write :func:`capture` and :func:`restore` over a tuple of attribute names,
deep copies of plain Python/torch/numpy objects. Flower counts rounds from 1 in every call
of ``Strategy.start``; :func:`shift_rounds` makes a strategy that runs on Flower's round
loop see the run's absolute round numbers (clients seed their local training with it), and
strategies that keep their own round counter across calls say so with ``counts_own_rounds``.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Iterable, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["Resumable", "StateError", "capture", "restore", "strategy_state", "load_strategy_state",
           "resync_clients", "shift_rounds", "rng_state", "set_rng_state"]


class StateError(ValueError):
    """A state dict that does not fit the strategy it is loaded into."""


@runtime_checkable
class Resumable(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def capture(obj: Any, attrs: Iterable[str]) -> dict[str, Any]:
    """Deep copies of ``obj``'s attributes ``attrs`` (an object with its own ``state_dict``,
    a DP mechanism say, contributes that instead)."""
    out: dict[str, Any] = {}
    for name in attrs:
        value = getattr(obj, name)
        out[name] = {"__state_dict__": value.state_dict()} if _has_state_dict(value) else copy.deepcopy(value)
    return out


def restore(obj: Any, state: dict[str, Any], attrs: Iterable[str]) -> None:
    """Set ``obj``'s attributes ``attrs`` from ``state`` (as :func:`capture` made it)."""
    attrs = tuple(attrs)
    missing, unexpected = sorted(set(attrs) - set(state)), sorted(set(state) - set(attrs))
    if missing or unexpected:
        raise StateError(f"state of {type(obj).__name__} does not fit: missing {missing or 'nothing'}, "
                         f"unexpected {unexpected or 'nothing'}")
    for name in attrs:
        value = state[name]
        if isinstance(value, dict) and set(value) == {"__state_dict__"}:
            target = getattr(obj, name)
            if not _has_state_dict(target):
                raise StateError(f"{type(obj).__name__}.{name} was saved with its state_dict but is "
                                 f"{type(target).__name__} now")
            target.load_state_dict(copy.deepcopy(value["__state_dict__"]))
        else:
            setattr(obj, name, copy.deepcopy(value))


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def strategy_state(strategy: Any) -> dict[str, Any]:
    """``{"class": ..., "state": strategy.state_dict()}``; a strategy without the protocol
    cannot be checkpointed and says so."""
    if not isinstance(strategy, Resumable):
        raise StateError(f"{type(strategy).__name__} cannot be checkpointed: it has no state_dict/load_state_dict "
                         f"(see fedswarm.strategies.resumable)")
    return {"class": _qualname(strategy), "state": strategy.state_dict()}


def load_strategy_state(strategy: Any, saved: dict[str, Any]) -> None:
    """Load what :func:`strategy_state` saved into a freshly built ``strategy``."""
    if not isinstance(strategy, Resumable):
        raise StateError(f"{type(strategy).__name__} cannot be resumed: it has no load_state_dict")
    if saved.get("class") != _qualname(strategy):
        raise StateError(f"the checkpoint holds the state of {saved.get('class')}, the run builds "
                         f"{_qualname(strategy)}: was the strategy or its code changed?")
    strategy.load_state_dict(saved["state"])


def resync_clients(strategy: Any) -> bool:
    """Ask ``strategy`` to resynchronise every client next round; False if it keeps no
    client-side state to resynchronise."""
    hook = getattr(strategy, "resync_clients", None)
    if callable(hook):
        hook()
        return True
    return False


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


_ROUND_HOOKS = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")


def shift_rounds(strategy: Any, offset: int) -> None:
    """Make Flower's round loop call ``strategy``'s round hooks with ``offset + round``.

    ``Strategy.start`` numbers rounds from 1; a run resumed after round R (or extended by
    ``add_rounds``) must number them R+1, R+2... as the uninterrupted run did, because
    clients seed their local training with the round they are told. Strategies that drive
    the rounds themselves and count across calls (``counts_own_rounds = True``) are left
    alone. Calling it again changes the offset."""
    if getattr(strategy, "counts_own_rounds", False):
        return
    base = strategy.__dict__.setdefault("_round_hooks", {name: getattr(strategy, name) for name in _ROUND_HOOKS})
    for name, hook in base.items():
        if offset == 0:
            strategy.__dict__.pop(name, None)
        else:
            setattr(strategy, name, _shifted(hook, int(offset)))


def _shifted(hook, offset: int):
    def call(server_round: int, *args, **kwargs):
        return hook(server_round + offset, *args, **kwargs)

    call.__name__ = getattr(hook, "__name__", "hook")
    return call


def rng_state() -> dict[str, Any]:
    """The process-wide random states a run draws from (Flower's node sampling uses
    ``random``; torch's and numpy's global generators)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
