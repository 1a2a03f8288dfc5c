"""One strategy build per run (issue 43 item 3): the engine's config check builds the run's
strategy (with its DP calibration) and the run takes it, on every engine that drives a
strategy object; the run's numbers are those of a build in the run (the engine-equality and
resume tests hold them), and a prepared strategy is taken once, for its own config only."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import fedswarm.server.app as server_app
from fedswarm.algorithms.privacy import dp_fedavg
from fedswarm.cli import app
from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout
from fedswarm.tasks import get_task


@pytest.fixture
def counts(monkeypatch):
    seen = {"builds": 0, "dp": 0}
    build, dp_init = server_app.build_strategy, dp_fedavg.ClientLevelDP.__init__

    def counted_build(*a, **kw):
        seen["builds"] += 1
        return build(*a, **kw)

    def counted_dp(self, *a, **kw):
        seen["dp"] += 1
        return dp_init(self, *a, **kw)

    monkeypatch.setattr(server_app, "build_strategy", counted_build)
    monkeypatch.setattr(dp_fedavg.ClientLevelDP, "__init__", counted_dp)
    return seen


@pytest.mark.parametrize("args", [["--strategy", "fedavg", "--dp", "noise_multiplier=1"],
                                  ["--strategy", "fedavg", "--engine", "batched", "--dp", "noise_multiplier=1"],
                                  ["--strategy", "compressed_fedavg", "--engine", "batched", "--dp",
                                   "noise_multiplier=1"],
                                  ["--strategy", "hl"]])
def test_a_cli_run_builds_its_strategy_once(args, counts, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_DB", str(tmp_path / "runs.db"))
    out = CliRunner().invoke(app, ["sim", "--rounds", "2", "--clients", "4", "--local-steps", "1", *args])
    assert out.exit_code == 0, out.output
    assert counts["builds"] == 1
    assert counts["dp"] == (1 if "--dp" in args else 0)


def test_a_prepared_strategy_is_taken_once_and_for_its_own_config_only(counts):
    cfg = RunConfig(strategy="compressed_fedavg", clients=4)
    layout = ParamLayout.from_module(get_task(cfg.task).model(cfg.seed))
    prepared = server_app.prepare_strategy(cfg)
    assert counts["builds"] == 1
    assert server_app.strategy_for(cfg.model_copy(update={"seed": 1}), layout, prepared) is not prepared.strategy
    assert server_app.strategy_for(cfg, layout, prepared) is prepared.strategy
    assert server_app.strategy_for(cfg, layout, prepared) is not prepared.strategy  # it holds one run's state
    assert counts["builds"] == 3
