"""docs/architecture.md's "How to add a strategy", kept honest: a strategy registered inside this
test (no other file touched) is listed by ``fedswarm strategies --json`` with what it can do, is
named in ``fedswarm sim --help`` among the strategies and those the batched engine serves, and
runs on the batched engine with the in-process engine's models (to 1e-5, the engine-equality
tests' check) and with its own builder's strategy object doing the round."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from fedswarm.cli import app
from fedswarm.config import RunConfig
from fedswarm.hyperparams import HyperParam
from fedswarm.strategies import registry
from fedswarm.strategies.federated.compressed_fedavg import CompressedFedAvg, client_update
from fedswarm.strategies.registry import Batched, BuildContext, StrategyEntry
from tests.test_batched import _models, same_models_on_both_engines

NAME = "toy_topk"


def _build(params: dict, ctx: BuildContext) -> CompressedFedAvg:
    """Top-k FedAvg with error feedback at the toy's own ratio: compressed_fedavg's client half,
    so the batched engine's ``codec`` round runner serves it."""
    cfg = ctx.config
    return CompressedFedAvg(ctx.layout, codec="topk", codec_params={"ratio": params["ratio"]},
                            fraction_train=cfg.fraction, min_available_nodes=cfg.clients, seed=cfg.seed)


@pytest.fixture
def toy():
    entry = registry.register(StrategyEntry(
        name=NAME, description="A toy: top-k FedAvg with error feedback, registered by a test.", build=_build,
        hyperparams=(HyperParam("ratio", 0.1, "share of coordinates each client sends", gt=0.0, le=1.0),),
        client_update=client_update, batched=Batched("codec", byzantine=True)))
    try:
        yield entry
    finally:
        registry.unregister(NAME)


def test_the_catalog_lists_it_with_what_it_can_do(toy):
    out = CliRunner().invoke(app, ["strategies", "--json"])
    assert out.exit_code == 0, out.output
    got = {s["name"]: s for s in json.loads(out.output)["strategies"]}[NAME]
    assert got["kind"] == "federated" and got["message_type"] == f"train.{NAME}"
    assert got["engines"] == ["inprocess", "flower", "batched"]
    assert got["batched"] == {"runner": "codec", "dp": False, "byzantine": True}
    assert (got["dp"], got["byzantine"], got["secagg"]) == (False, True, False)
    assert got["policy_keys"] == list(registry.LOCAL_POLICY_KEYS)
    assert [h["name"] for h in got["hyperparams"]] == ["ratio"]
    md = CliRunner().invoke(app, ["strategies", "--markdown"]).output
    assert f"| `{NAME}` | federated | inprocess, flower, batched | - | yes |" in md


def test_sim_help_names_it_among_the_strategies_and_the_batched_ones(toy):
    out = CliRunner().invoke(app, ["sim", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out.output).split())
    strategy_help = text[text.index("--strategy"):text.index("--task")]
    batched_help = text[text.index("batched (every sampled client"):text.index("clock (")]
    assert NAME in strategy_help and NAME in batched_help
    registry.unregister(NAME)  # gone from the registry: gone from the help
    text = CliRunner().invoke(app, ["sim", "--help"], terminal_width=200, env={"COLUMNS": "200"}).output
    assert NAME not in text


def test_it_runs_on_the_batched_engine_as_in_process(toy, tmp_path, monkeypatch):
    kw = dict(strategy=NAME, clients=8, rounds=2, local_steps=2, fraction=0.75, lr=0.1, params={"ratio": 0.05})
    _, got, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    assert got["config"]["engine"] == "batched"
    for ref_row, got_row in pairs:
        assert got_row["bytes_up"] == ref_row["bytes_up"]
    # the toy's own builder ran the round: the same models as compressed_fedavg at its codec and ratio, and
    # not the same as at another ratio
    same, _ = _models(RunConfig(engine="batched", **{**kw, "strategy": "compressed_fedavg",
                                                     "params": {"codec": "topk", "codec_params": "ratio=0.05"}}),
                      tmp_path, monkeypatch)
    toy_models, _ = _models(RunConfig(engine="batched", **kw), tmp_path, monkeypatch)
    other, _ = _models(RunConfig(engine="batched", **{**kw, "params": {"ratio": 0.5}}), tmp_path, monkeypatch)
    assert all(bool((a == b).all()) for a, b in zip(same, toy_models))
    assert not bool((other[-1] == toy_models[-1]).all())


def test_the_readme_table_is_the_registry_s():
    """README's "What each strategy runs on" is `fedswarm strategies --markdown`, regenerated."""
    from pathlib import Path

    from fedswarm.sim.report import strategy_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- strategy-table: begin -->\n")[1].split("<!-- strategy-table: end -->")[0]
    assert block == strategy_table(), "README's strategy table is stale: paste `fedswarm strategies --markdown`"


def test_the_how_to_in_docs_architecture_is_what_the_code_takes():
    """docs/architecture.md's "How to add a strategy": every field its example sets is a
    StrategyEntry field, its runner a batched round runner, its kinds the registry's."""
    import dataclasses
    from pathlib import Path

    from fedswarm.sim.batched import ROUND_RUNNERS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    section = doc.split("## How to add a strategy")[1].split("\n## ")[0]
    example = section.split("```python")[1].split("```")[0]
    fields = {f.name for f in dataclasses.fields(StrategyEntry)}
    used = set(re.findall(r"^\s+(\w+)=", example, flags=re.M))
    assert used and used <= fields, used - fields
    assert set(re.findall(r'Batched\("(\w+)"\)', example)) <= set(ROUND_RUNNERS)
    assert re.search(r"kind=\"\w+\",\s+# " + r" \| ".join(registry.KINDS) + ":", example)
    assert "tests/test_add_a_strategy.py" in section
