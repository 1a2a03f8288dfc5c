"""Typed hyperparameters with defaults and ranges, shared by every algorithm and strategy.

A :class:`HyperParam` names one knob of an algorithm (a codec's ratio, a gossip rule's
momentum), its default, and its allowed range. The strategy registry, the codec and
decentralized-algorithm catalogs, the CLI's ``--set`` and the dashboard's form all read
them. No Flower here: the algorithm layer (``fedswarm.algorithms``) uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedswarm.config import ConfigError

__all__ = ["HyperParam"]


@dataclass(frozen=True)
class HyperParam:
    """One strategy hyperparameter, with its default, type and allowed range."""

    name: str
    default: Any
    help: str
    ge: float | None = None
    le: float | None = None
    gt: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None

    @property
    def type(self) -> type:
        return type(self.default)

    def allowed(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        parts = []
        if self.gt is not None:
            parts.append(f"> {self.gt}")
        if self.ge is not None:
            parts.append(f">= {self.ge}")
        if self.lt is not None:
            parts.append(f"< {self.lt}")
        if self.le is not None:
            parts.append(f"<= {self.le}")
        kind = self.type.__name__
        return f"{kind} " + " and ".join(parts) if parts else kind

    def check(self, value: Any, strategy: str) -> Any:
        """Coerce ``value`` to this parameter's type and check its range."""
        where = f"invalid value for '{strategy}.{self.name}'"
        t = self.type
        try:
            if t is bool:
                if isinstance(value, str):
                    if value.lower() not in ("true", "false"):
                        raise ValueError
                    value = value.lower() == "true"
                elif not isinstance(value, bool):
                    raise ValueError
            elif t is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                value = int(value)
            elif t is float:
                if isinstance(value, bool):
                    raise ValueError
                value = float(value)
            elif t is str:
                value = str(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {self.allowed()} (got {value!r})") from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: expected {self.allowed()} (got {value!r})")
        bad = (
            (self.ge is not None and value < self.ge)
            or (self.le is not None and value > self.le)
            or (self.gt is not None and value <= self.gt)
            or (self.lt is not None and value >= self.lt)
        )
        if bad:
            raise ConfigError(f"{where}: expected {self.allowed()} (got {value!r})")
        return value
