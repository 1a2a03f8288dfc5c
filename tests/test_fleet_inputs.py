"""Bad fleet options (issue 45) are refused before a run starts, in one line that names the option
and what is wrong, as a new user meets them from ``fedswarm sim``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedswarm.cli import app
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError


@pytest.mark.parametrize("values, needle", [
    (dict(clients=8, fraction=0.5, quorum=6), "'quorum': 6 replies asked for, a round samples only 4 of the 8"),
    (dict(clients=8, over_select=1.5), "'over_select': 1.5 samples no more nodes at fraction 1"),
    (dict(clients=8, devices="edge-wifi:8", availability="foo:on=10,off=10"),
     "'availability': device class(es) foo not in this run's --devices (edge-wifi)"),
])
def test_fleet_options_that_cannot_work_are_refused(values, needle):
    with pytest.raises(ConfigError) as err:
        RunConfig.build(values)
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def test_fleet_options_that_work_are_kept():
    cfg = RunConfig.build(dict(clients=8, fraction=0.5, over_select=1.5, quorum=6, devices="edge-wifi:6,straggler:2",
                               availability="straggler:on=10,off=10"))
    assert (cfg.quorum, cfg.over_select) == (6, 1.5)


@pytest.mark.parametrize("text, needle", [("", "has no windows"), ("node,start_s,end_s\n", "has no windows"),
                                          ("node,start_s\n0,0\n", "line 1: the header must be")])
def test_a_bad_trace_is_named_under_its_option_without_the_whole_config(tmp_path, text, needle):
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    with pytest.raises(ConfigError) as err:
        RunConfig.build(dict(clients=8, devices="edge-wifi:8", availability=str(trace)))
    msg = str(err.value)
    assert msg.startswith("invalid value for 'availability': availability trace") and needle in msg, msg
    assert "'clients'" not in msg  # not the whole config dict


def test_cli_refuses_quorum_zero_in_one_line():
    out = CliRunner().invoke(app, ["sim", "--clients", "8", "--rounds", "1", "--quorum", "0"])
    assert out.exit_code == 2 and "--quorum must be at least 1 reply, got 0" in out.output, out.output


def test_sim_help_cuts_no_syntax_at_80_columns():
    out = CliRunner().invoke(app, ["sim", "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert out.exit_code == 0 and "…" not in out.output, [ln for ln in out.output.splitlines() if "…" in ln]
