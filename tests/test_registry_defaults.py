"""Every registered strategy runs with its defaults: ``fedswarm sim --strategy S --rounds 1``
(in process, through the CLI's own option handling and default resolution), and a strategy's
run defaults yield to what the user chose."""

import pytest
from typer.testing import CliRunner

from fedswarm.cli import app
from fedswarm.store import Store
from fedswarm.strategies import registry


def _sim(tmp_path, monkeypatch, *args: str):
    monkeypatch.setenv("FEDSWARM_DB", str(tmp_path / "runs.db"))
    result = CliRunner().invoke(app, ["sim", *args])
    store = Store(tmp_path / "runs.db")
    try:
        runs = store.list_runs()
        return result, runs, [store.rounds(r.id) for r in runs]
    finally:
        store.close()


@pytest.mark.parametrize("name", registry.names())
def test_every_strategy_runs_one_round_with_its_defaults(name, tmp_path, monkeypatch):
    result, runs, rounds = _sim(tmp_path, monkeypatch, "--strategy", name, "--rounds", "1")
    assert result.exit_code == 0, result.output
    assert [r.status for r in runs] == ["finished"] and max(r.round for r in rounds[0]) == 1
    for key, value in registry.get(name).run_defaults.items():
        assert runs[0].config[key] == value


@pytest.mark.parametrize("name", ["easgd", "d2"])
def test_the_array_engine_takes_the_same_defaults(name, tmp_path, monkeypatch):
    result, runs, _ = _sim(tmp_path, monkeypatch, "--strategy", name, "--engine", "array", "--rounds", "1")
    assert result.exit_code == 0, result.output
    assert [(r.status, r.config["engine"], r.config["topology"]) for r in runs] == [
        ("finished", "array", registry.get(name).run_defaults["topology"])]


@pytest.mark.parametrize("args,error", [
    (("--strategy", "easgd", "--topology", "ring"), "easgd cannot use topology 'ring'"),
    (("--strategy", "d2", "--topology", "ring", "--engine", "array"), "d2 cannot use topology 'ring'"),
    (("--strategy", "progfed", "--task", "digits-mlp"), "progfed needs a staged model"),
])
def test_an_explicit_option_wins_over_the_strategy_s_default(args, error, tmp_path, monkeypatch):
    result, runs, _ = _sim(tmp_path, monkeypatch, *args, "--rounds", "1")
    assert result.exit_code == 2 and error in result.output and runs == []


def test_run_defaults_fill_only_what_is_unset():
    assert registry.with_run_defaults({"strategy": "easgd"})["topology"] == "complete"
    assert registry.with_run_defaults({"strategy": "easgd", "topology": "exp"})["topology"] == "exp"
    assert registry.with_run_defaults({"strategy": "d2", "engine": "array"}) == {
        "strategy": "d2", "engine": "array", "topology": "ring+lazy"}
    assert registry.with_run_defaults({"strategy": "progfed"})["task"] == "digits-cnn4"
    assert "topology" not in registry.with_run_defaults({})  # fedavg: RunConfig's own defaults
