"""Typed hyperparameters with defaults and ranges, shared by every algorithm and strategy.

A :class:`HyperParam` names one knob of an algorithm (a codec's ratio, a gossip rule's
momentum), its default, and its allowed range. The strategy registry, the codec and
decentralized-algorithm catalogs, the CLI's ``--set`` and the dashboard's form all read
them. No Flower here: the algorithm layer (``fedswarm.algorithms``) uses it too.

A default is written once, where the code that uses it declares it: a parameter declared with
:data:`SIGNATURE` as its default takes it from the constructor's keyword argument of the same
name (:func:`defaults_from`; given a class, also the arguments its ``__init__`` passes on to its
bases through ``**kwargs``), and one that repeats the constructor's default is refused, unless the
caller keeps it on purpose (a sentinel or a string the constructor does not take as is).

Values are checked by pydantic (a ``TypeAdapter`` built from the parameter's type, bounds
and choices): the CLI, the registry and the dashboard (``fedswarm.web.services.validation``, from the
catalog's JSON through :meth:`HyperParam.from_spec`) share this one check.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Annotated, Any, Callable, Iterable, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from fedswarm.errors import ConfigError

__all__ = ["HyperParam", "SIGNATURE", "defaults_from"]


class _Signature:
    def __repr__(self) -> str:
        return "SIGNATURE"


#: A :class:`HyperParam`'s default when :func:`defaults_from` reads it from the constructor.
SIGNATURE: Any = _Signature()


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

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "HyperParam":
        """The parameter a catalog entry describes (``fedswarm strategies --json``: name,
        default, help, bounds, choices), so a reader of the catalog checks values the same way."""
        choices = spec.get("choices")
        return cls(name=str(spec.get("name", "")), default=spec.get("default"), help=str(spec.get("help", "")),
                   ge=spec.get("ge"), le=spec.get("le"), gt=spec.get("gt"), lt=spec.get("lt"),
                   choices=tuple(choices) if choices is not None else None)

    @cached_property
    def _adapter(self) -> TypeAdapter:
        t = self.type if self.type in (bool, int, float, str) else str
        if self.choices is not None:
            kind: Any = Literal[tuple(self.choices)]
        else:
            bounds = {k: v for k, v in (("ge", self.ge), ("le", self.le), ("gt", self.gt), ("lt", self.lt))
                      if v is not None}
            kind = Annotated[t, Field(allow_inf_nan=False, **bounds) if t is float else Field(**bounds)]
        return TypeAdapter(kind, config=ConfigDict(coerce_numbers_to_str=True) if t is str else None)

    def check(self, value: Any, strategy: str, *, where: str | None = None) -> Any:
        """``value`` coerced to this parameter's type and checked against its range and
        choices (by pydantic); ConfigError naming ``strategy.name`` (or ``where``) if not."""
        where = where or f"{strategy}.{self.name}"
        t = self.type
        bad = ConfigError(f"invalid value for '{where}': expected {self.allowed()} (got {value!r})")
        if isinstance(value, bool) != (t is bool) and not (t is bool and isinstance(value, str)):
            raise bad  # True is no number nor a name, and 1 is no flag ('true'/'false' strings are)
        if self.choices is not None and t in (int, float) and isinstance(value, str):
            try:
                value = t(value)
            except ValueError:
                raise bad from None
        try:
            return self._adapter.validate_python(value)
        except ValidationError:
            raise bad from None


def defaults_from(fn: Callable[..., Any], params: Iterable[HyperParam], *,
                  kept: Iterable[str] = ()) -> tuple[HyperParam, ...]:
    """``params`` with each :data:`SIGNATURE` default replaced by the default of ``fn``'s
    argument of the same name (``fn``: the constructor the parameters are passed to).

    ``fn`` may be a class: its arguments are then its ``__init__``'s and, while an ``__init__``
    passes ``**kwargs`` on, those of the next ``__init__`` up the MRO (a subclass's own default
    wins over its base's). A subclass that fixes a base argument in its ``super().__init__`` call
    is not seen: declare no hyperparameter of that name. ``kept`` names parameters whose default
    is written here on purpose, being something the constructor does not take as is (a sentinel
    or a string the builder translates); the caller says why. TypeError at import when a default
    is missing or written twice, here and in ``fn``."""
    args = _arguments(fn)
    kept = frozenset(kept)
    where = getattr(fn, "__qualname__", repr(fn))
    out = []
    for h in params:
        arg = args.get(h.name)
        default = inspect.Parameter.empty if arg is None else arg.default
        if h.default is SIGNATURE:
            if default is inspect.Parameter.empty or h.name in kept:
                raise TypeError(f"hyperparameter '{h.name}' takes its default from {where}, which has none")
            h = replace(h, default=default)
        elif default is not inspect.Parameter.empty and h.name not in kept:
            raise TypeError(f"hyperparameter '{h.name}': default written twice ({h.default!r} here, "
                            f"{default!r} in {where}); declare it with SIGNATURE")
        out.append(h)
    return tuple(out)


def _arguments(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """``fn``'s named arguments; for a class, its constructor's, following ``**kwargs`` up the MRO."""
    if not isinstance(fn, type):
        return dict(inspect.signature(fn).parameters)
    out: dict[str, inspect.Parameter] = {}
    for klass in fn.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        for p in params:
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                out.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out
