"""``KEY=VALUE`` pairs, typed: the one parser behind ``--set``, ``--policy CLASS:KEY=VALUE``,
``--attack NAME:k=v,...``, ``--dp k=v,...``, codec parameters and the dashboard's form.

Without declared types a value reads as a bool (``true``/``false``, any case), an int, a
float, or else stays a string, so ``--set`` and a TOML file give a strategy the same values.
With ``types``, every key must be declared and its value must read as the declared type.
A leaf module (no fedswarm imports), so every layer may use it; errors are ValueError
naming the pair that is wrong and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["parse_value", "parse_typed", "parse_pair", "parse_pairs", "parse_items"]

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def parse_value(text: str) -> bool | int | float | str:
    """``text`` as a bool (true/false, any case), an int, a float, or the stripped string."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_typed(text: str, kind: type) -> Any:
    """``text`` read as ``kind`` (bool, int, float or str); ValueError saying what was expected.
    A float must be finite; an int written as a float (``2.0``) is refused rather than cut."""
    raw = text.strip()
    value: Any = raw if kind is str else parse_value(raw)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok or (kind is float and not math.isfinite(value)):
        raise ValueError(f"expected {_TYPE_WORDS.get(kind, kind.__name__)}, got '{raw}'")
    return value


def parse_pair(item: str, *, what: str) -> tuple[str, str]:
    """``"key=value"`` split at the first ``=`` (the value may hold more), both stripped;
    ValueError naming ``what`` and the item when there is no ``=`` or no key."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{what}: bad pair '{item.strip()}': expected KEY=VALUE")
    return key.strip(), value.strip()


def _typed_pair(item: str, *, what: str, types: Mapping[str, type] | None) -> tuple[str, Any]:
    key, raw = parse_pair(item, what=what)
    if types is None:
        return key, parse_value(raw)
    if key not in types:
        raise ValueError(f"{what}: unknown key '{key}' in '{item.strip()}' (keys: {', '.join(types) or 'none'})")
    try:
        return key, parse_typed(raw, types[key])
    except ValueError as exc:
        raise ValueError(f"{what}: bad value for '{key}': {exc}") from None


def parse_pairs(text: str, *, what: str, types: Mapping[str, type] | None = None) -> dict[str, Any]:
    """``"a=1,b=true"`` -> ``{"a": 1, "b": True}``; empty items are skipped. With ``types``
    (key -> bool, int, float or str) unknown keys and values of the wrong type are refused."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, value = _typed_pair(item, what=what, types=types)
        out[key] = value
    return out


def parse_items(items: Iterable[str] | None, *, what: str,
                types: Mapping[str, type] | None = None) -> dict[str, Any]:
    """Repeated ``KEY=VALUE`` options (``--set a=1 --set codec_params=ratio=0.1,levels=4``), one
    pair each: a value may itself hold commas and ``=``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, value = _typed_pair(item, what=what, types=types)
        out[key] = value
    return out
