"""Fleets that sleep (issue 45): quorum rounds, eligibility at sampling, simulated availability.

Oracles: a dead node and a round_timeout of 600 s, where the quorum round must end long before
the timeout (a thread joined with a deadline; the barrier round without the quorum is shown to
wait for its timeout); the on/off process's long-run share of time on against ``on / (on + off)``
(the renewal-reward theorem), integrated exactly over its windows; a trace's windows against the
rounds' recorded simulated start and end times; eligibility rules against hand-written verdicts.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

import pytest

from fedswarm.availability import Availability, OnOff, availability_for, load_trace, parse_process
from fedswarm.config import RunConfig
from fedswarm.eligibility import parse_rules
from fedswarm.errors import ConfigError
from fedswarm.server.metered_grid import WrappingGrid
from fedswarm.server.prompt_grid import pull_replies
from fedswarm.store import Store

TASK = "synthetic-logreg"


# -- eligibility rules ------------------------------------------------------------------------
def test_rules_verdicts_and_absent_values_pass():
    rules = parse_rules("battery>=40,charging,temp<45")
    assert rules.why_not({"battery_pct": 80.0, "power_source": "ac", "cpu_temp_c": 30.0}) is None
    why = rules.why_not({"battery_pct": 5.0, "power_source": "battery", "cpu_temp_c": 50.0})
    assert "battery 5" in why and "not charging" in why and "temp 50" in why
    assert rules.why_not({"battery_pct": 40.0, "power_source": "ac"}) is None  # >= holds at the bound; no temp
    assert rules.why_not({}) is None and rules.why_not(None) is None  # nothing reported yet: eligible
    assert parse_rules("!charging").why_not({"power_source": "ac"}) == "charging"
    assert parse_rules("rss<=100").why_not({"peak_rss_mb": 100.5}) is not None
    assert str(parse_rules(" battery >= 40 , charging ")) == "battery>=40,charging"


@pytest.mark.parametrize("spec, bad", [("battery>>40", "battery>>40"), ("battery>=40,,charging", "empty clause"),
                                       ("volts>3", "volts>3"), ("battery>=forty", "battery>=forty")])
def test_rules_parse_errors_name_the_clause(spec, bad):
    with pytest.raises(ConfigError, match="eligible") as err:
        parse_rules(spec)
    assert bad in str(err.value) and "\n" not in str(err.value)


def test_run_config_refuses_bad_fleet_options_in_one_line():
    for values, needle in [({"eligible": "battery=40"}, "bad clause 'battery=40'"),
                           ({"availability": "on=10,off=5"}, "give --devices"),
                           ({"availability": "on=10", "devices": "edge-wifi:20"}, "'off'"),
                           ({"quorum": 21}, "21 replies"), ({"over_select": 0.5}, "over_select")]:
        with pytest.raises(ConfigError) as err:
            RunConfig.build(values)
        assert needle in str(err.value), err.value


# -- the availability process -----------------------------------------------------------------
def _on_time(av: Availability, pid: int, horizon: float) -> float:
    av.next_on(pid, horizon, limit=0.0)  # generate the windows up to the horizon
    return sum(max(0.0, min(e, horizon) - s) for s, e in av._windows[pid] if s < horizon)


def test_long_run_share_on_is_on_over_on_plus_off():
    proc = OnOff(on=300.0, off=700.0)
    n, horizon = 200, 200_000.0
    av = Availability(n, processes=[proc] * n, seed=3)
    share = sum(_on_time(av, p, horizon) for p in range(n)) / (n * horizon)
    assert share == pytest.approx(0.3, abs=0.01)  # renewal-reward: E[on] / (E[on] + E[off])
    # a point check agrees: the share of nodes on at a fixed late time
    assert sum(av.available(p, 150_000.0) for p in range(n)) / n == pytest.approx(0.3, abs=0.1)


def test_diurnal_process_is_on_more_at_noon_than_at_midnight_and_deterministic():
    proc = parse_process("on=600,off=600,diurnal=0.9,period=86400")["*"]
    n = 300
    av = Availability(n, processes=[proc] * n, seed=1)
    days = range(1, 6)
    noon = sum(av.available(p, d * 86_400 + 43_200) for p in range(n) for d in days)
    midnight = sum(av.available(p, d * 86_400) for p in range(n) for d in days)
    assert noon > 1.5 * midnight, (noon, midnight)
    again = Availability(n, processes=[proc] * n, seed=1)
    assert [again.available(p, 100_000.0) for p in range(n)] == [av.available(p, 100_000.0) for p in range(n)]
    other = Availability(n, processes=[proc] * n, seed=2)
    assert [other.available(p, 100_000.0) for p in range(n)] != [av.available(p, 100_000.0) for p in range(n)]


def test_dropout_rate_and_per_class_processes():
    av = availability_for("edge-wifi:on=100,off=1,dropout=0.25;straggler:on=1,off=100", ["edge-wifi"] * 400
                          + ["straggler"] * 10 + ["gpu"] * 10, seed=0)
    drops = sum(av.drops(p, r) for p in range(400) for r in range(1, 11))
    assert drops / 4000 == pytest.approx(0.25, abs=0.03)
    assert not any(av.drops(p, 1) for p in range(400, 420))  # no dropout given / class not named
    assert all(av.available(p, 12_345.0) for p in range(410, 420))  # a class not named: always there
    with pytest.raises(ConfigError, match="'cpu' not in this run's --devices|cpu not in"):
        availability_for("cpu:on=1,off=1", ["gpu"], seed=0)


@pytest.mark.parametrize("text, line, needle", [
    ("node,start,end\n0,0,1\n", 1, "header"),
    ("node,start_s,end_s\n0,0,10\n1,5\n", 3, "3 fields"),
    ("node,start_s,end_s\n0,10,5\n", 2, "start_s < end_s"),
    ("node,start_s,end_s\n0,0,1\n7,0,1\n", 3, "not a partition id"),
    ("node,start_s,end_s\nx,0,1\n", 2, "integer"),
])
def test_trace_loader_refuses_a_malformed_csv_with_its_line(tmp_path, text, line, needle):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_trace(path, 4)
    assert f"line {line}:" in str(err.value) and needle in str(err.value), err.value


def test_trace_windows_are_merged_and_a_node_without_one_is_never_on(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("node,start_s,end_s\n0,10,20\n0,15,30\n0,50,60\n")
    av = availability_for(str(path), ["edge-wifi"] * 2, seed=0)
    assert av.available(0, 25.0) and not av.available(0, 40.0) and av.session_end(0, 12.0) == 30.0
    assert av.next_on(0, 31.0) == 50.0 and av.next_on(0, 61.0) is None
    assert not any(av.available(1, t) for t in (0.0, 10.0, 1e6)) and av.next_on(1, 0.0) is None


# -- quorum rounds ----------------------------------------------------------------------------
class DeadNodeGrid(WrappingGrid):
    """A grid where node ``dead`` takes its messages and never answers (a phone asleep): a round
    without a quorum waits ``timeout`` for it, as on a SuperLink."""

    def __init__(self, inner, dead: int):
        super().__init__(inner)
        self.dead = dead

    def pull_messages(self, message_ids: Iterable[str]):
        return [m for m in self.inner.pull_messages(message_ids) if m.metadata.src_node_id != self.dead]

    def send_and_receive(self, messages, *, timeout=None):
        waiting = {mid for mid in self.push_messages(messages) if mid}
        return pull_replies(self, waiting, timeout=timeout)


def _run_dead_node(tmp_path, name: str, **options) -> tuple[threading.Thread, dict, Store, str]:
    from fedswarm.client.app import app as client_app
    from fedswarm.server.app import run_server
    from fedswarm.sim.inprocess import InProcessGrid

    cfg = RunConfig(task=TASK, clients=4, rounds=2, seed=0, local_steps=1, **options)
    store = Store(tmp_path / f"{name}.db")
    run_id = store.create_run(cfg.model_dump())
    grid = DeadNodeGrid(InProcessGrid(client_app, cfg.clients, run_config=cfg.to_flat()), dead=4)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(status=run_server(grid, cfg, store=store, run_id=run_id)),
                              daemon=True)
    thread.start()
    return thread, out, store, run_id


def test_a_quorum_round_ends_without_waiting_for_a_node_that_never_answers(tmp_path):
    thread, out, store, run_id = _run_dead_node(tmp_path, "quorum", quorum=3, round_timeout=600.0)
    thread.join(timeout=120.0)  # far under one round_timeout: a barrier round would still be waiting
    assert not thread.is_alive() and out["status"] == "finished"
    rounds = [r for r in store.rounds(run_id) if r.round > 0]
    assert len(rounds) == 2 and all(r.wall_s < 60.0 and r.num_clients == 3 for r in rounds)
    rows = store.node_rounds(run_id)
    late = [r for r in rows if r.status == "late"]
    assert sorted((r.round, r.node_id) for r in late) == [(1, "4"), (2, "4")]
    assert all("quorum of 3" in r.reason for r in late)
    assert not [r for r in rows if r.status == "failed"]  # late, not failed
    assert {r.node_id for r in rows if r.status == "ok"} == {"1", "2", "3"}


def test_without_a_quorum_the_round_waits_for_its_timeout(tmp_path):
    thread, out, store, run_id = _run_dead_node(tmp_path, "barrier", round_timeout=1.5)
    thread.join(timeout=120.0)
    assert not thread.is_alive() and out["status"] == "finished"
    rounds = [r for r in store.rounds(run_id) if r.round > 0]
    assert all(r.wall_s >= 1.5 for r in rounds)  # the dead node held each round to the timeout
    assert {(r.node_id, r.status) for r in store.node_rounds(run_id) if r.node_id == "4"} == {("4", "failed")}


def _inprocess(tmp_path, name: str, cfg: RunConfig) -> tuple[Store, str]:
    from fedswarm.sim.run import run_engine

    store = Store(tmp_path / f"{name}.db")
    run_id = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=run_id) == "finished"
    return store, run_id


def test_simulated_quorum_keeps_the_first_to_finish_and_over_selects(tmp_path):
    cfg = RunConfig(task=TASK, clients=10, rounds=3, seed=0, local_steps=2, fraction=0.3, over_select=1.5,
                    devices="edge-wifi:8,straggler:2")
    store, run_id = _inprocess(tmp_path, "sim", cfg)
    rows = store.node_rounds(run_id)
    for rnd in (1, 2, 3):
        mine = [r for r in rows if r.round == rnd]
        assert len(mine) == int(10 * 0.3 * 1.5)  # sampled 4: over-selected from the 3 needed
        assert sum(r.status == "ok" for r in mine) == 3  # the quorum: the nodes needed
        late = [r for r in mine if r.status == "late"]
        assert len(late) == 1
        # a straggler, if sampled, is never kept before an edge-wifi node (it finishes later)
        if any(int(r.node_id) > 8 for r in mine):
            assert int(late[0].node_id) > 8, [(r.node_id, r.status) for r in mine]


# -- eligibility on the in-process engine -----------------------------------------------------
@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_ineligible_nodes_are_never_sampled_and_their_rows_say_why(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")  # every simulated node's probe reads 5 %
    # the run's rule keeps 5 % out; the stragglers' own class rule lets them in
    cfg = RunConfig(task=TASK, engine=engine, clients=4, rounds=3, seed=0, local_steps=1,
                    devices="edge-wifi:2,straggler:2", eligible="battery>=40",
                    policies={"straggler": {"eligible": "battery<=10"}})
    store, run_id = _inprocess(tmp_path, "eligible", cfg)
    rows = store.node_rounds(run_id)
    assert {r.node_id for r in rows if r.status == "ok"} == {"3", "4"}
    skipped = [r for r in rows if r.status == "ineligible"]
    assert sorted((r.round, r.node_id) for r in skipped) == [(1, "1"), (1, "2"), (2, "1"), (2, "2"), (3, "1"),
                                                             (3, "2")]
    assert all("battery 5 fails battery>=40" in r.reason for r in skipped)
    nodes = {n.id.split(":")[1]: n for n in store.list_nodes(run_id)}
    assert nodes["1"].status == "ineligible"
    # (the batched engine's rounds write a trained node's rows, not a nodes-table entry: only those not picked)
    assert nodes["3"].status == "online" if engine == "inprocess" else "3" not in nodes


def test_no_eligible_node_fails_the_round_saying_why(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    cfg = RunConfig(task=TASK, clients=2, rounds=1, seed=0, local_steps=1, eligible="battery>=40",
                    round_timeout=0.5)
    from fedswarm.sim.run import run_engine

    store = Store(tmp_path / "none.db")
    run_id = store.create_run(cfg.model_dump())
    with pytest.raises(RuntimeError, match="0 eligible node"):
        run_engine(cfg, store=store, run_id=run_id)


# -- availability on the in-process engine ----------------------------------------------------
@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_a_run_with_a_trace_never_trains_a_node_outside_its_window(engine, tmp_path):
    base = RunConfig(task=TASK, clients=4, rounds=1, seed=0, local_steps=1, devices="edge-wifi:4")
    store, run_id = _inprocess(tmp_path, "probe-time", base)
    t1 = [r for r in store.rounds(run_id) if r.round == 1][0].sim_time_s  # one round's simulated seconds
    windows = {0: [(0.0, 1e9)], 1: [(0.0, 1e9)], 2: [(0.0, 1.5 * t1)], 3: [(2.5 * t1, 1e9)]}
    trace = tmp_path / "fleet.csv"
    trace.write_text("node,start_s,end_s\n" + "".join(f"{n},{s!r},{e!r}\n" for n, ws in windows.items()
                                                       for s, e in ws))
    cfg = RunConfig(**{**base.model_dump(), "rounds": 5, "availability": str(trace), "round_timeout": 1000.0,
                       "engine": engine})
    store, run_id = _inprocess(tmp_path, "trace", cfg)
    rounds = sorted((r for r in store.rounds(run_id) if r.round > 0), key=lambda r: r.round)
    start, t = {}, 0.0
    for r in rounds:
        start[r.round] = t
        t += r.sim_time_s
    rows = store.node_rounds(run_id)
    for r in rows:
        pid = int(r.node_id) - 1
        s, e = start[r.round], start[r.round] + [x for x in rounds if x.round == r.round][0].sim_time_s
        inside = any(ws <= s and e <= we + 1e-9 for ws, we in windows[pid])
        if r.status == "ok":
            assert inside, (r.round, r.node_id, s, e)
        if r.status == "unavailable":
            assert not any(ws <= s < we for ws, we in windows[pid])
    by = {(r.round, r.node_id): r.status for r in rows}
    assert by[(1, "3")] == "ok" and by[(2, "3")] == "dropped" and by[(3, "3")] == "unavailable"
    assert by[(1, "4")] == "unavailable" and by[(3, "4")] == "ok"
    assert "went offline mid-round" in [r.reason for r in rows if r.status == "dropped"][0]
    # round 2 waited for the node that went offline until round_timeout (no quorum): 1000 simulated s
    assert math.isclose(start[3], t1 + 1000.0, rel_tol=1e-6) and math.isclose(start[2], t1, rel_tol=1e-3)


# -- the dashboard's Nodes page ---------------------------------------------------------------
def test_the_nodes_page_says_why_a_node_was_not_picked(tmp_path):
    from fedswarm.web.models import SuperNodesOut
    from fedswarm.web.services.fleet import FleetQuery, fleet, node_detail

    store = Store(tmp_path / "nodes.db")
    run_id = store.create_run(RunConfig().model_dump())
    store.set_status(run_id, "running")
    reason = "not eligible (battery>=40): battery 5 fails battery>=40"
    store.add_round(run_id, 1, nodes=[{"node_id": "77", "status": "ineligible", "reason": reason},
                                      {"node_id": "78", "status": "ok"}])
    store.add_round(run_id, 2, nodes=[{"node_id": "77", "status": "ineligible", "reason": reason}])
    store.upsert_nodes({"77": {"kind": "supernode", "run_id": run_id, "status": "ineligible"},
                        "78": {"kind": "supernode", "run_id": run_id, "status": "online"}})
    page = {n.id: n for n in fleet(store, SuperNodesOut(configured=False), FleetQuery()).nodes}
    assert page["77"].state == "online"
    assert page["77"].state_detail == f"not picked in round 2 of run {run_id}: {reason}"
    assert "not picked" not in page["78"].state_detail
    assert node_detail(store, "77", SuperNodesOut(configured=False)).node.state_detail == page["77"].state_detail


def test_engines_and_strategies_that_do_not_run_the_fleet_options_say_so():
    from fedswarm.sim.engines import check_config

    with pytest.raises(ConfigError, match="^--quorum: run on --engine inprocess, flower, batched .*not on the array "
                                          "engine: it has no federated rounds"):
        check_config(RunConfig(task=TASK, engine="array", strategy="dpsgd", quorum=3))
    with pytest.raises(ConfigError, match="--eligible: for synchronous federated strategies; 'dpsgd' is"):
        check_config(RunConfig(task=TASK, strategy="dpsgd", eligible="charging"))
    assert check_config(RunConfig(task=TASK, quorum=3)).name == "inprocess"


def test_fake_battery_is_read_by_the_probe_only_when_set(tmp_path, monkeypatch):
    from fedswarm.telemetry import battery

    supply = tmp_path / "sys/class/power_supply/BAT0"
    supply.mkdir(parents=True)
    (supply / "type").write_text("Battery\n")
    (supply / "capacity").write_text("80\n")
    assert battery(tmp_path)["battery_pct"] == 80.0
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "5")
    assert battery(tmp_path)["battery_pct"] == 5.0
    assert battery(tmp_path / "nothing-here") == {"battery_pct": 5.0}  # no power_supply folder at all
    monkeypatch.setenv("FEDSWARM_FAKE_BATTERY", "low")
    with pytest.raises(ValueError, match="FEDSWARM_FAKE_BATTERY"):
        battery(tmp_path)


@pytest.mark.parametrize("fleet", [{"quorum": 3}, {"over_select": 1.5, "fraction": 0.5}, {"eligible": "battery>=40"}])
def test_secagg_refuses_the_fleet_options_in_one_line(fleet):
    """Secure aggregation runs its own stages and dropout recovery: the fleet grid is not wired into them,
    so the combination is refused before the run starts, naming the option."""
    from fedswarm.sim.engines import check_run

    cfg = RunConfig(strategy="fedavg", secagg=True, clients=5, **fleet)
    with pytest.raises(ConfigError, match=r"^--secagg with --(quorum|over-select|eligible): not supported") as exc:
        check_run(cfg)
    assert "\n" not in str(exc.value)
