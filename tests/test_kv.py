"""The one KEY=VALUE parser (fedswarm.kv) and the options built on it: typed values, and
errors that name the pair that is wrong."""

import pytest

from fedswarm.algorithms.privacy.dp_fedavg import parse_dp
from fedswarm.algorithms.robust.attacks import parse_attack
from fedswarm.kv import parse_items, parse_pairs, parse_typed, parse_value


@pytest.mark.parametrize("text,value", [
    ("1", 1), (" -3 ", -3), ("0.5", 0.5), ("1e-3", 1e-3), ("true", True), ("FALSE", False),
    ("topk", "topk"), ("ring+lazy", "ring+lazy"), ("", ""),
])
def test_values_are_typed(text, value):
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_pairs_and_items():
    assert parse_pairs("a=1, b=0.5,,c=true,d=topk", what="x") == {"a": 1, "b": 0.5, "c": True, "d": "topk"}
    assert parse_pairs("", what="x") == {}
    # one pair per repeated option: the value keeps its commas and '='
    assert parse_items(["codec_params=ratio=0.1,levels=4", "k = 2"], what="--set") == {
        "codec_params": "ratio=0.1,levels=4", "k": 2}
    assert parse_items(None, what="--set") == {}


def test_declared_types():
    types = {"clip": float, "steps": int, "adaptive": bool, "name": str}
    got = parse_pairs("clip=2,steps=3,adaptive=True,name=7", what="x", types=types)
    assert got == {"clip": 2.0, "steps": 3, "adaptive": True, "name": "7"}
    assert type(got["clip"]) is float and type(got["name"]) is str
    assert parse_typed("1", float) == 1.0 and parse_typed("on", str) == "on"


@pytest.mark.parametrize("text,types,match", [
    ("a", None, r"--x: bad pair 'a': expected KEY=VALUE"),
    ("=1", None, r"--x: bad pair '=1'"),
    ("a=1,b", None, r"bad pair 'b'"),
    ("clip=1,sigma=2", {"clip": float}, r"--x: unknown key 'sigma' in 'sigma=2' \(keys: clip\)"),
    ("clip=abc", {"clip": float}, r"--x: bad value for 'clip': expected a finite number, got 'abc'"),
    ("clip=inf", {"clip": float}, r"bad value for 'clip': expected a finite number"),
    ("clip=true", {"clip": float}, r"bad value for 'clip'"),
    ("steps=2.5", {"steps": int}, r"bad value for 'steps': expected an integer, got '2.5'"),
    ("steps=false", {"steps": int}, r"expected an integer"),
    ("on=1", {"on": bool}, r"bad value for 'on': expected true or false, got '1'"),
])
def test_bad_pairs_are_named(text, types, match):
    with pytest.raises(ValueError, match=match):
        parse_pairs(text, what="--x", types=types)


def test_options_share_the_parser():
    """--attack and --dp read their pairs through it: same types, same messages."""
    assert parse_attack("gaussian:std=2,add=true").params == {"std": 2.0, "add": True}
    with pytest.raises(ValueError, match=r"attack 'gaussian': bad value for 'add': expected true or false"):
        parse_attack("gaussian:add=1")
    spec = parse_dp("noise_multiplier=1,adaptive=true,clip=3")
    assert (spec.noise_multiplier, spec.adaptive, spec.clip) == (1.0, True, 3.0)
    with pytest.raises(ValueError, match=r"--dp-sgd: unknown key 'sigma'"):
        parse_dp("sigma=1", "dp_sgd")
