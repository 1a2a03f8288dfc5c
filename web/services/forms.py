"""The new-run form: its fields from the catalog, and the config it posts."""

from __future__ import annotations

import json
from typing import Any

from fedswarm.errors import ConfigError
from fedswarm.kv import parse_items, parse_typed, parse_value
from fedswarm.web.services.catalog import CatalogData, FieldSpec, config_fields

__all__ = ["config_from_form", "form_fields"]


def form_fields(cat: CatalogData) -> list[FieldSpec]:
    return config_fields(cat.config_schema)


def _convert(text: str, spec: FieldSpec) -> Any:
    """A form string as the field's type; a bad one is passed on for RunConfig to name."""
    try:
        if spec.kind in ("int", "float"):
            return parse_typed(text, int if spec.kind == "int" else float)
        if spec.kind == "bool":
            return text.lower() in ("true", "on", "1", "yes")
        if spec.kind == "json":
            return json.loads(text)
    except ValueError:
        return text
    return text


def config_from_form(form: dict[str, str], cat: CatalogData) -> dict[str, Any]:
    """The raw config (validated later by the run service) from the posted form."""
    raw: dict[str, Any] = {}
    for key in ("task", "strategy"):
        if form.get(key, "").strip():
            raw[key] = form[key].strip()
    for spec in form_fields(cat):
        text = form.get(spec.name)
        if text is None or not text.strip() or text.strip() == spec.input_value:
            continue  # empty or as pre-filled: the field's default, or the strategy's own (its run_defaults)
        raw[spec.name] = _convert(text.strip(), spec)
    prefix = f"p.{raw.get('strategy', '')}."
    params = {k[len(prefix):]: parse_value(v.strip()) for k, v in form.items()
              if k.startswith(prefix) and v.strip()}
    extra = [line.strip() for line in form.get("params_extra", "").splitlines() if line.strip()]
    try:
        params.update(parse_items(extra, what="extra parameters"))
    except ValueError as exc:  # names the bad line
        raise ConfigError(str(exc)) from None
    if params:
        raw["params"] = params
    return raw
