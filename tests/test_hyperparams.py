"""Hyperparameter values are checked once, by pydantic, for the CLI/registry and the
dashboard alike."""

from __future__ import annotations

import pytest

from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam
from fedswarm.web.validation import ValidationFailed, check_value

RATIO = HyperParam("ratio", 0.01, "share kept", gt=0.0, le=1.0)
K = HyperParam("k", 4, "count", ge=1, le=64)
EF = HyperParam("error_feedback", True, "keep residual")
MERGE = HyperParam("merge", "tree", "how", choices=("tree", "exact"))


@pytest.mark.parametrize("hp,value,want", [
    (RATIO, "0.5", 0.5), (RATIO, 1, 1.0), (K, "7", 7), (K, 7.0, 7), (EF, "false", False), (EF, True, True),
    (MERGE, "exact", "exact"),
])
def test_accepted_values_are_coerced(hp, value, want):
    got = hp.check(value, "s")
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("hp,value", [
    (RATIO, 0.0), (RATIO, 1.5), (RATIO, "nan"), (RATIO, float("inf")), (RATIO, True), (RATIO, "x"),
    (K, 7.5), (K, 0), (K, 65), (K, True), (EF, "maybe"), (EF, 1), (EF, 0.0), (MERGE, "other"), (MERGE, 3),
])
def test_refused_values_name_the_key_and_the_range(hp, value):
    with pytest.raises(ConfigError, match=rf"invalid value for 's\.{hp.name}': expected {hp.type.__name__}|"
                                          rf"invalid value for 's\.{hp.name}': expected one of"):
        hp.check(value, "s")


def test_the_dashboard_uses_the_same_check_from_the_catalog_spec():
    spec = {"name": "k", "default": 4, "help": "count", "ge": 1, "le": 64, "type": "int", "choices": None}
    assert check_value(spec, "9", "topk.k") == 9
    for bad in (0, 7.5, True, "x"):
        with pytest.raises(ValidationFailed, match=r"invalid value for 'topk\.k': expected int >= 1 and <= 64"):
            check_value(spec, bad, "topk.k")
    assert HyperParam.from_spec(spec) == K.__class__("k", 4, "count", ge=1, le=64)
