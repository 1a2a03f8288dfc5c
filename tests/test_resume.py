"""Server checkpoints and resume of a killed ServerApp.

- every stateful strategy's ``state_dict`` survives the trip through a checkpoint's bytes
  into a freshly built strategy;
- a run stopped dead after round R and resumed from the store (in this process, with
  nothing carried over but the store) ends with the same model as the same run
  uninterrupted, every round recorded once, for every kind of strategy state;
- a client whose own state was lost is resynchronised by the protocol, not by luck;
- the real thing: ``fedswarm sim`` killed with SIGKILL in the middle of a round, then
  ``fedswarm resume RUN_ID``, in subprocesses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout
from fedswarm.server.app import build_strategy
from fedswarm.errors import CheckpointError
from fedswarm.server.checkpoint import dumps, load_latest, loads
from fedswarm.server.resume import prepare_resume
from fedswarm.sim.run import run_engine
from fedswarm.store import Store
from fedswarm.store.liveness import owner_fields
from fedswarm.strategies.resumable import StateError, load_strategy_state, restore, strategy_state
from fedswarm.tasks import get_task
from fedswarm.wire import arrayrecord_to_vector
from tests.helpers import wait_until
from tests.resume_helpers import HOLD_ENV

ROOT = Path(__file__).resolve().parents[1]

# name -> (run config overrides) ; small runs: 4 clients, 4 rounds, a few local steps
CASES = {
    "fedavg": {},
    "fedavg-dp": {"strategy": "fedavg", "dp": "noise_multiplier=0.5,clip=1.0,adaptive=true"},
    "compressed_fedavg": {"params": {"codec": "topk", "error_feedback": True}},
    "onebit": {},
    "fetchsgd": {},
    "gtopk": {},
    "pvt": {},
    "progfed": {"task": "digits-cnn4"},
    "hl": {"params": {"selector": "learned"}},
    # the DQN selector: greedy from episode 2, trained from its replay memory after every episode
    "hl-attention": {"rounds": 7, "params": {"selector": "attention", "max_episode_rounds": 2, "epsilon_decay": 5.0,
                                            "dqn_passes": 2}},
    "dpsgd": {"topology": "ring"},
    "draco": {"clients": 3},
    "median": {"byzantine": 1, "attack": "gaussian", "clients": 5},
}


class Crash(Exception):
    """Stands for the process dying after a round was recorded."""


def _cfg(name: str, **extra) -> RunConfig:
    values = {"strategy": name.split("-")[0], "clients": 4, "rounds": 4, "local_steps": 2, "seed": 3}
    values.update(CASES.get(name, {}))
    values.update(extra)
    return RunConfig.build(values)


def _final_model(store: Store, run_id: str) -> torch.Tensor:
    return arrayrecord_to_vector(load_latest(store, run_id).arrays)


def _rounds(store: Store, run_id: str) -> list[int]:
    return [r.round for r in store.rounds(run_id)]


def _crash_after(rnd: int):
    def listener(r: int, _row: dict) -> None:
        if r == rnd:
            raise Crash(f"after round {r}")

    return listener


def _uninterrupted(cfg: RunConfig, store: Store) -> str:
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    return rid


def _crashed(cfg: RunConfig, store: Store, after: int) -> str:
    rid = store.create_run(cfg.model_dump())
    with pytest.raises(Crash):
        run_engine(cfg, store=store, run_id=rid, listeners=[_crash_after(after)])
    assert store.get_run(rid).status == "failed"
    return rid


@pytest.mark.parametrize("name", sorted(CASES))
def test_resumed_run_ends_with_the_uninterrupted_model(name, tmp_path):
    """Stop after round 2, resume from the store alone: the final model is the uninterrupted
    run's (1e-5) and rounds 0..4 are each recorded once."""
    cfg = _cfg(name)
    store = Store(tmp_path / "store.db")
    ref = _uninterrupted(cfg, store)
    rid = _crashed(cfg, store, after=2)
    cfg2, ck = prepare_resume(store, rid)
    # HL checkpoints when its hop's learning is done, after the listeners: its last
    # checkpoint is round 1's, and round 2, recorded after it, is redone.
    assert ck.round == (1 if name.startswith("hl") else 2)
    assert run_engine(cfg2, store=store, run_id=rid, resume=ck) == "finished"
    assert _rounds(store, rid) == list(range(cfg.rounds + 1)) == _rounds(store, ref)
    assert load_latest(store, rid).round == cfg.rounds
    a, b = _final_model(store, rid), _final_model(store, ref)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    accs = [r.test_accuracy for r in store.rounds(rid)]
    assert accs == pytest.approx([r.test_accuracy for r in store.rounds(ref)], abs=1e-6)
    assert any(e.kind == "resumed" for e in store.events(rid))


@pytest.mark.parametrize("name", ["fedavg", "compressed_fedavg"])
def test_resume_from_a_checkpoint_k_rounds_apart(name, tmp_path):
    """--checkpoint-every 2, 5 rounds, the process dies after round 3: the newest checkpoint
    is round 2's, round 3 is redone (its rows deleted, not doubled) and the model is the
    uninterrupted run's (1e-5). Checkpoints exist only for rounds 2, 4 and the final 5."""
    cfg = _cfg(name, rounds=5, checkpoint_every=2)
    store = Store(tmp_path / "store.db")
    ref_store = Store(tmp_path / "ref.db")
    ref = _uninterrupted(cfg, ref_store)
    written: list[int] = []
    save = store.save_checkpoint
    store.save_checkpoint = lambda run_id, rnd, data, **kw: (written.append(rnd), save(run_id, rnd, data, **kw))
    rid = _crashed(cfg, store, after=3)
    assert written == [2] and _rounds(store, rid) == [0, 1, 2, 3]
    cfg2, ck = prepare_resume(store, rid)
    assert ck.round == 2 and cfg2.checkpoint_every == 2
    assert run_engine(cfg2, store=store, run_id=rid, resume=ck) == "finished"
    assert written == [2, 4, 5]
    assert _rounds(store, rid) == [0, 1, 2, 3, 4, 5] == _rounds(ref_store, ref)
    assert len([n for n in store.node_rounds(rid) if n.round == 3]) == 4  # round 3's nodes once, not twice
    torch.testing.assert_close(_final_model(store, rid), _final_model(ref_store, ref), rtol=0, atol=1e-5)
    assert [r.test_accuracy for r in store.rounds(rid)] == pytest.approx(
        [r.test_accuracy for r in ref_store.rounds(ref)], abs=1e-6)
    (event,) = [e for e in store.events(rid) if e.kind == "resumed"]
    assert event.data["dropped_rounds"] == 1


def test_checkpoint_every_is_validated():
    for bad in (0, -1, "two"):
        with pytest.raises(ValueError, match="checkpoint_every"):
            RunConfig.build({"checkpoint_every": bad})
    assert RunConfig.build({}).checkpoint_every == 1


def _as_deployment_checkpoint(store: Store, rid: str) -> None:
    """Rewrite the run's newest checkpoint as a deployment's ServerApp writes it: without the
    clients' state (Flower's grid has none to give; the SuperNodes keep it in Context.state)."""
    ck = load_latest(store, rid)
    ck.grid = None
    store.save_checkpoint(rid, ck.round, dumps(ck))
    store.update_run(rid, engine="deployment")


def _as_ray_cluster_checkpoint(store: Store, rid: str) -> None:
    """... and as Flower's engine on a Ray cluster writes it: nodes that keep no state of their
    own (the actors of a partition may run on another machine after the resume)."""
    _as_deployment_checkpoint(store, rid)
    run = store.get_run(rid)
    store.update_run(rid, engine="flower", config={**run.config, "ray_address": "127.0.0.1:1"})


@pytest.mark.parametrize("name", ["compressed_fedavg", "dpsgd", "fedavg"])
def test_resume_that_would_lose_client_state_is_refused_or_says_so(name, tmp_path):
    """Where the nodes keep no state of their own (Flower's engine on a Ray cluster), a resume
    of a strategy with client state (error-feedback residuals, replicas, decentralized nodes'
    models) is refused, naming what is lost; accepted, the run finishes with the loss in its
    'resumed' event and every node named in a 'client_resync' event, and its model is NOT the
    uninterrupted one (the loss is real). A deployment (SuperNodes keep their state on disk)
    is not refused. A stateless strategy (fedavg) resumes as before, exactly."""
    from fedswarm.server.resume import client_state_lost

    cfg = _cfg(name)
    store = Store(tmp_path / "store.db")
    ref = _uninterrupted(cfg, store)
    rid = _crashed(cfg, store, after=2)
    assert client_state_lost(prepare_resume(store, rid)[1]) is None  # the in-process checkpoint holds the clients
    _as_deployment_checkpoint(store, rid)
    prepare_resume(store, rid)  # not refused: the SuperNodes are asked for their own state
    _as_ray_cluster_checkpoint(store, rid)
    if name == "fedavg":
        cfg2, ck = prepare_resume(store, rid)
        assert client_state_lost(ck) is None
    else:
        what = "error-feedback residual" if name == "compressed_fedavg" else "own model and algorithm memory"
        with pytest.raises(CheckpointError, match=f"cannot be resumed exactly: .*{what}.*--accept-client-state-loss"):
            prepare_resume(store, rid)
        cfg2, ck = prepare_resume(store, rid, accept_client_state_loss=True)
    assert run_engine(cfg2, store=store, run_id=rid, resume=ck) == "finished"
    assert _rounds(store, rid) == [0, 1, 2, 3, 4]
    (event,) = [e for e in store.events(rid) if e.kind == "resumed"]
    a, b = _final_model(store, rid), _final_model(store, ref)
    if name == "fedavg":
        assert event.data["client_state_lost"] is None
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    else:
        assert "4 node(s) had no state of their own" in event.data["client_state_lost"] and "LOST" in event.message
        assert len(event.data["resynchronised_nodes"]) == 4
        resyncs = [e for e in store.events(rid) if e.kind == "client_resync"]
        assert sorted(e.data["partition"] for e in resyncs) == [0, 1, 2, 3]
        assert (a - b).abs().max() > 1e-4  # what was lost changed the model


def test_cli_refuses_a_lossy_resume_and_not_a_deployment_one(tmp_path):
    """`fedswarm resume RUN` of a strategy with client state on a Ray cluster run: exit 2 with the
    reason, before anything is started. A deployment run is not refused (its SuperNodes keep
    their state): it goes on to `flwr run`, which fails here for want of a SuperLink."""
    cfg = _cfg("compressed_fedavg")
    store = Store(tmp_path / "store.db")
    rid = _crashed(cfg, store, after=2)
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLWR_HOME=str(tmp_path / "flwr"))
    _as_ray_cluster_checkpoint(store, rid)
    done = subprocess.run([sys.executable, "-m", "fedswarm", "resume", rid, "--db", str(tmp_path / "store.db")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, out
    assert "cannot be resumed exactly" in out and "error-feedback residual" in out, out
    store.update_run(rid, engine="deployment")
    done = subprocess.run([sys.executable, "-m", "fedswarm", "resume", rid, "--db", str(tmp_path / "store.db"),
                           "--federation", "nowhere"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1 and "flwr run failed" in out and "cannot be resumed exactly" not in out, out


def _same(a, b, path="state") -> None:
    """Deep equality of two state trees (tensors, arrays, records, plain objects)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.random.Generator):
        assert a.bit_generator.state == b.bit_generator.state, path
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), path
        _same(vars(a), vars(b), f"{path}<{type(a).__name__}>")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_round_trips_through_a_checkpoint(name, tmp_path):
    """The state after two rounds, through the checkpoint's bytes and into a freshly built
    strategy, comes out unchanged; and it is not the fresh strategy's state (it carries
    something), except for the strategies that keep nothing between rounds."""
    cfg = _cfg(name, rounds=2)
    store = Store(tmp_path / "store.db")
    rid = _uninterrupted(cfg, store)
    ck = loads(dumps(load_latest(store, rid)))
    layout = ParamLayout.from_module(get_task(cfg.task).model(cfg.seed))
    fresh = build_strategy(cfg, layout)
    before = strategy_state(fresh)["state"]
    load_strategy_state(fresh, ck.strategy)
    _same(strategy_state(fresh)["state"], ck.strategy["state"])
    if name in ("fedavg", "pvt"):
        assert ck.strategy["state"] == {} == before
    else:
        with pytest.raises(AssertionError):
            _same(before, ck.strategy["state"])


def test_a_state_that_does_not_fit_is_refused_by_name(tmp_path):
    cfg = _cfg("onebit", rounds=1)
    layout = ParamLayout.from_module(get_task(cfg.task).model(cfg.seed))
    strategy = build_strategy(cfg, layout)
    state = strategy_state(strategy)
    with pytest.raises(StateError, match="fedavg|FedAvg|holds the state of"):
        load_strategy_state(build_strategy(_cfg("fedavg"), layout), state)
    broken = dict(state["state"])
    del broken["sync"]
    with pytest.raises(StateError, match=r"missing \['sync'\]"):
        restore(strategy, broken, strategy.state_attrs)


def test_resume_refuses_runs_without_a_checkpoint_or_finished(tmp_path):
    store = Store(tmp_path / "store.db")
    with pytest.raises(CheckpointError, match="no run 'ghost'"):
        prepare_resume(store, "ghost")
    rid = store.create_run(_cfg("fedavg").model_dump())
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        prepare_resume(store, rid)
    done = _uninterrupted(_cfg("fedavg", rounds=1), store)
    with pytest.raises(CheckpointError, match="finished"):
        prepare_resume(store, done)
    # a run whose process still runs is not resumed twice; once that process is gone, it is
    live = _crashed(_cfg("fedavg", rounds=2), store, after=1)
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        store.update_run(live, status="running", **owner_fields(other.pid))
        with pytest.raises(CheckpointError, match=f"running in process {other.pid}"):
            prepare_resume(store, live)
    finally:
        other.communicate(b"")
    assert prepare_resume(store, live)[1].round == 1


def test_a_checkpoint_naming_a_huge_memo_index_is_refused_without_allocating_for_it():
    """One altered byte turned a checkpoint's BINPUT into a LONG_BINPUT of index ~1.5e9 (found by
    scripts/fuzz, kept in tests/fuzz_corpus/server_checkpoint): CPython's C unpickler sized its
    memo array for it (~11 GB, ~30 s) before the file was refused. Refused now, with what
    Python allocates while reading it far below that."""
    import tracemalloc

    bad = (Path(__file__).parent / "fuzz_corpus" / "server_checkpoint" / "b1cec027549088f2.bin").read_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="cannot be read"):
            loads(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated to read a 2 KB file"


def test_store_keeps_the_newest_checkpoints_in_one_transaction(tmp_path):
    store = Store(tmp_path / "store.db")
    rid = store.create_run({"strategy": "fedavg"})
    for r in range(1, 5):
        store.save_checkpoint(rid, r, f"ck{r}".encode(), keep=2)
    assert store.checkpoint_data(rid) == (4, b"ck4")
    assert store.latest_checkpoint(rid).round == 4
    # a checkpoint of an earlier round (a resumed run redoing rounds) replaces the later ones
    store.save_checkpoint(rid, 2, b"again", keep=2)
    assert store.checkpoint_data(rid) == (2, b"again")
    for r in range(6):
        store.add_round(rid, r, bytes_up=1)
        store.add_node_rounds(rid, r, [{"node_id": "1"}])
    assert store.drop_rounds_after(rid, 3) == 2
    assert _rounds(store, rid) == [0, 1, 2, 3] and {n.round for n in store.node_rounds(rid)} == {0, 1, 2, 3}


def _first_resumed_round_failures(store: Store, rid: str, rnd: int) -> list[str]:
    return [n.reason or "" for n in store.node_rounds(rid) if n.round == rnd and n.status != "ok"]


def test_clients_that_lost_their_state_are_resynchronised(tmp_path, monkeypatch):
    """Resumed where the engine could not give the clients' state back (a new Flower run,
    a restarted device): 1-bit SGD's replicas and residuals are gone. The strategy sends
    every node the full model and the round loses no update; without the resync the nodes
    fail the round with 'replica out of step' (what this test would catch)."""
    cfg = _cfg("onebit")
    store = Store(tmp_path / "store.db")
    for resync in (True, False):
        rid = _crashed(cfg, store, after=2)
        cfg2, ck = prepare_resume(store, rid)
        ck.grid = None  # the nodes come back empty
        if not resync:
            from fedswarm.strategies.federated.compressed_base import CompressedStrategy

            monkeypatch.setattr(CompressedStrategy, "rejoin_clients", lambda self, reports: None)
        assert run_engine(cfg2, store=store, run_id=rid, resume=ck) == "finished"
        failures = _first_resumed_round_failures(store, rid, 3)
        if resync:
            assert failures == []
            events = [e.message for e in store.events(rid) if e.kind == "resumed"]
            assert events and "resynchronised by the protocol" in events[0]
            assert len([e for e in store.events(rid) if e.kind == "client_resync"]) == cfg.clients
        else:
            assert len(failures) == cfg.clients and all("replica out of step" in f for f in failures)
        assert _rounds(store, rid) == [0, 1, 2, 3, 4]


# -- the real thing: SIGKILL in the middle of a round, `fedswarm resume` --------------------


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedswarm", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish in {timeout} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{out[-3000:]}"
    return out


SIM_ARGS = ["sim", "--task", "tests.resume_helpers:make_task", "--clients", "4", "--rounds", "4",
            "--local-steps", "3", "--seed", "5"]


def test_sigkill_mid_round_then_resume_matches_uninterrupted(tmp_path):
    """`fedswarm sim` is killed with SIGKILL while its clients train round 3 (the test task
    holds training step 2·4·3 + 1, and tells the test it is there); `fedswarm resume RUN_ID`
    then finishes the run in the same store: same final model as an uninterrupted run
    (1e-5), rounds 0..4 each recorded once, status finished."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop(HOLD_ENV, None)
    ref_db, db, hold = tmp_path / "ref.db", tmp_path / "run.db", tmp_path / "hold"
    hold.mkdir()
    reference = _cli(*SIM_ARGS, "--db", str(ref_db), env=env)
    victim = _cli(*SIM_ARGS, "--db", str(db), env=dict(env, **{HOLD_ENV: f"{2 * 4 * 3}:{hold}"}))
    try:
        held = wait_until(lambda: list(hold.glob("held-*")) or victim.poll() is not None, 300,
                          interval=0.05, what="the run holding in round 3")
        assert held is not True and victim.poll() is None, victim.communicate()[0][-3000:]
        assert int(held[0].name.split("-")[1]) == victim.pid
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    _finish(reference)
    store = Store(db)
    (run,) = store.list_runs()
    assert run.status == "running"  # nothing could record the death: it was SIGKILL
    assert _rounds(store, run.id) == [0, 1, 2] and store.latest_checkpoint(run.id).round == 2
    out = _finish(_cli("resume", run.id, "--db", str(db), env=env))
    assert "resuming run" in out and "after round 2" in out
    store = Store(db)
    run = store.get_run(run.id)
    assert run.status == "finished", run.error
    assert _rounds(store, run.id) == [0, 1, 2, 3, 4]
    ref_store = Store(ref_db)
    (ref,) = ref_store.list_runs()
    torch.testing.assert_close(_final_model(store, run.id), _final_model(ref_store, ref.id), rtol=0, atol=1e-5)
    assert [r.test_accuracy for r in store.rounds(run.id)] == pytest.approx(
        [r.test_accuracy for r in ref_store.rounds(ref.id)], abs=1e-6)
