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


def test_defaults_are_read_from_the_constructor_once():
    """A SIGNATURE default is the constructor's own; repeating it, or naming an argument with no
    default, fails at import (TypeError) instead of letting the two copies drift apart."""
    from fedswarm.hyperparams import SIGNATURE, defaults_from

    class Step:
        def __init__(self, size: int, lr: float = 0.25, nesterov: bool = True, *, name: str = "sgd"):
            pass

    got = defaults_from(Step.__init__, (HyperParam("lr", SIGNATURE, "step", gt=0.0), K,
                                        HyperParam("nesterov", SIGNATURE, "flag"),
                                        HyperParam("name", SIGNATURE, "label")))
    assert [(h.name, h.default, h.type) for h in got] == [("lr", 0.25, float), ("k", 4, int),
                                                          ("nesterov", True, bool), ("name", "sgd", str)]
    assert got[0].check("0.5", "s") == 0.5
    with pytest.raises(TypeError, match=r"'lr': default written twice \(0.25 here, 0.25 in"):
        defaults_from(Step.__init__, (HyperParam("lr", 0.25, "step"),))
    for missing in ("missing", "size"):  # no such argument; an argument without a default
        with pytest.raises(TypeError, match=rf"'{missing}' takes its default from .*Step.__init__, which has none"):
            defaults_from(Step.__init__, (HyperParam(missing, SIGNATURE, "?"),))


def test_the_registry_shows_the_constructors_defaults():
    """What `fedswarm strategies` lists is what the classes use when built without arguments."""
    import inspect

    from fedswarm.algorithms.decentralized.catalog import ALGORITHMS
    from fedswarm.strategies import registry
    from fedswarm.strategies.edge.hl import HomogeneousLearning
    from fedswarm.strategies.edge.progfed import ProgFed

    owners = {name: e.cls for name, e in ALGORITHMS.items()} | {"hl": HomogeneousLearning, "progfed": ProgFed}
    for name, cls in owners.items():
        args = inspect.signature(cls.__init__).parameters
        shown = {h.name: h.default for h in registry.get(name).hyperparams if h.name in args}
        assert shown and shown == {k: args[k].default for k in shown}, name
