"""Which codecs run under secure aggregation: the codecs marked linear are additive (the
payload of a sum is the sum of the payloads, same seed), the others are not, and a config
that asks secure aggregation of a non-linear codec is refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fedswarm.algorithms.compression.codecs import CODECS, make_codec
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout
from fedswarm.strategies.secagg_compat import NONLINEAR_WHY, check_linear_codecs, codec_refusal, linear_codecs


def _arrays(codec, x, layout, seed):
    return codec.encode(x, layout, seed=seed).arrays


def _layout_of(d: int) -> ParamLayout:
    return ParamLayout.from_shapes([("w", (d // 8, 8))])


@pytest.mark.parametrize("name", sorted(CODECS))
def test_linear_means_additive(name):
    """Oracle for the `linear` flag: two nodes' payload arrays, summed, equal the payload of
    the summed vectors (same round seed); every codec not marked linear breaks it."""
    layout = _layout_of(4096)
    g = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(1, 4096, generator=g), torch.randn(1, 4096, generator=g) * 3
    params = {"ratio": 0.05} if name in ("topk", "randk") else {}
    codec = make_codec(name, **params)
    a1, a2, a12 = (_arrays(codec, v, layout, 77) for v in (x1, x2, x1 + x2))
    # float32 sums: equal to 1e-5 of the largest value
    additive = all(float((a1[k].double() + a2[k].double() - a12[k].double()).abs().max())
                   <= 1e-5 * float(a12[k].double().abs().max()) for k in a12)
    assert additive == CODECS[name].linear, f"{name}: additive={additive}, marked linear={CODECS[name].linear}"


def _cfg(secagg: bool = True, policies=None):
    return SimpleNamespace(secagg=secagg, policies=policies or {})


def test_linear_codecs_pass():
    assert set(linear_codecs()) == {"none", "randk", "countsketch"}
    for codec in linear_codecs():
        assert codec_refusal(_cfg(), {"codec": codec}) is None, codec
    assert codec_refusal(_cfg(), {}) is None  # a strategy without a codec


@pytest.mark.parametrize("codec", sorted(NONLINEAR_WHY))
def test_nonlinear_codec_is_refused_in_one_line(codec):
    with pytest.raises(ConfigError) as err:
        check_linear_codecs(_cfg(), {"codec": codec})
    text = str(err.value)
    assert "\n" not in text and f"codec '{codec}'" in text and NONLINEAR_WHY[codec] in text


def test_a_device_class_policy_naming_a_nonlinear_codec_is_refused():
    why = codec_refusal(_cfg(policies={"edge": {"codec": "topk"}}), {"codec": "countsketch"})
    assert why is not None and "policy of 'edge'" in why and "topk" in why


def test_no_secagg_no_check():
    check_linear_codecs(_cfg(secagg=False), {"codec": "topk"})
