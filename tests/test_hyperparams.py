"""Hyperparameter values are checked once, by pydantic, for the CLI/registry and the
dashboard alike."""

from __future__ import annotations

import pytest

from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam
from fedswarm.web.services.validation import ValidationFailed, check_value

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


def test_defaults_follow_kwargs_up_the_classes():
    """Given a class, an argument its ``__init__`` passes on through ``**kwargs`` has the base's
    default, unless the subclass sets its own; a base behind an ``__init__`` without ``**kwargs``
    is out of reach. ``kept`` lets a default that the constructor does not take stay written here."""
    from fedswarm.hyperparams import SIGNATURE, defaults_from

    class Base:
        def __init__(self, layout=None, *, server_lr: float = 1.0, seed: int = 0):
            pass

    class Mid(Base):
        def __init__(self, layout=None, density: float = 0.01, **kwargs):
            super().__init__(layout, **kwargs)

    class Top(Mid):
        def __init__(self, layout=None, server_lr: float = 2.0, **kwargs):
            super().__init__(layout, server_lr=server_lr, **kwargs)

    class Inherits(Top):  # no __init__ of its own: Top's
        pass

    class Closed(Base):
        def __init__(self, layout=None, density: float = 0.5):
            super().__init__(layout)

    lr, dens = HyperParam("server_lr", SIGNATURE, "step"), HyperParam("density", SIGNATURE, "share")
    assert [h.default for h in defaults_from(Mid, (lr, dens))] == [1.0, 0.01]
    for cls in (Top, Inherits):
        assert [h.default for h in defaults_from(cls, (lr, dens))] == [2.0, 0.01]
    assert [h.default for h in defaults_from(Closed, (dens,))] == [0.5]
    with pytest.raises(TypeError, match=r"'server_lr' takes its default from .*Closed, which has none"):
        defaults_from(Closed, (lr,))
    with pytest.raises(TypeError, match=r"'seed': default written twice \(-1 here, 0 in .*Top\)"):
        defaults_from(Top, (HyperParam("seed", -1, "seed (-1: the run's)"),))
    sentinel = HyperParam("seed", -1, "seed (-1: the run's)")
    assert defaults_from(Top, (sentinel,), kept=("seed",)) == (sentinel,)
    with pytest.raises(TypeError, match=r"'seed' takes its default from .*Top, which has none"):
        defaults_from(Top, (HyperParam("seed", SIGNATURE, "seed"),), kept=("seed",))


def _constructor_defaults(cls: type) -> dict:
    """The test's own reading of what ``cls()`` uses: each ``__init__`` up the MRO while they pass
    ``**kwargs`` on, the first one to name an argument deciding its default."""
    import inspect

    out: dict = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        for p in params:
            out.setdefault(p.name, p.default)
        if all(p.kind is not p.VAR_KEYWORD for p in params):
            return out
    return out


#: Hyperparameters whose listed default is not the constructor's, on purpose.
NOT_THE_CONSTRUCTORS = {
    # a 'k=v' string the builder parses; the constructor takes a dict (None: none)
    ("compressed_fedavg", "codec_params"), ("compressed_fedavg", "downlink_codec_params"),
    # -1: the run's --byzantine, put in its place by the builder (Signum's own f is 0)
    ("signum", "f"),
    # -1: the run's --byzantine; the constructor's s is required (no default)
    ("solon", "s"), ("draco", "s"),
    # -1: no limit, the builder's spelling of the constructor's None
    ("fedbuff", "max_staleness"),
}


def test_the_registry_shows_the_constructors_defaults():
    """What `fedswarm strategies` lists is what the classes use when built without arguments,
    for every registered strategy, but for the listed exceptions."""
    import inspect

    import fedswarm.strategies as fs
    from fedswarm.algorithms.decentralized.catalog import ALGORITHMS
    from fedswarm.strategies import registry
    from fedswarm.strategies.federated.fedavg import CheckedFedAvg
    from fedswarm.strategies.federated.fedbuff import FedBuff

    owners = {name: e.cls for name, e in ALGORITHMS.items()} | {
        "fedavg": CheckedFedAvg, "hl": fs.HomogeneousLearning, "progfed": fs.ProgFed,
        "pvt": fs.PartialVariableTraining, "compressed_fedavg": fs.CompressedFedAvg, "onebit": fs.OneBitSGD,
        "gtopk": fs.GlobalTopK, "sketched_sgd": fs.SketchedSGD, "fetchsgd": fs.FetchSGD,
        "gs_sgd": fs.GlobalSketchSGD, "fedbuff": FedBuff,
        "signum": fs.Signum, "solon": fs.CodedStrategy, "draco": fs.CodedStrategy,
    } | {rule: fs.RobustAggregation for rule in ("median", "trimmed_mean", "krum", "multikrum", "bulyan")}
    assert set(owners) == set(registry.names())  # a new strategy names its class here
    checked, excepted = 0, set()
    for name, cls in owners.items():
        args = _constructor_defaults(cls)
        for h in registry.get(name).hyperparams:
            if h.name not in args:
                continue
            if (name, h.name) in NOT_THE_CONSTRUCTORS:
                excepted.add((name, h.name))
                assert h.default != args[h.name], f"{name}.{h.name}: the same as the constructor's, not an exception"
            else:
                assert args[h.name] is not inspect.Parameter.empty, f"{name}.{h.name}: the constructor has no default"
                assert (h.default, h.type) == (args[h.name], type(args[h.name])), f"{name}.{h.name}"
                checked += 1
    assert excepted == NOT_THE_CONSTRUCTORS and checked > 60
