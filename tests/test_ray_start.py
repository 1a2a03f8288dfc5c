"""Ray's node registration wait is fixed at 30 s inside Ray; on an overloaded machine a node
can miss it. fedswarm's Flower engine starts Ray itself and retries that one error
(fedswarm.sim.flower_engine.start_ray); every other error ends the run at once."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from fedswarm.sim import flower_engine  # noqa: E402


class FakeRay:
    def __init__(self, errors):
        self.errors = list(errors)
        self.calls: list[dict] = []
        self.shutdowns = 0
        self.up = False

    def is_initialized(self):
        return self.up

    def init(self, **kw):
        self.calls.append(kw)
        if self.errors:
            self.up = True  # Ray leaves a half-started driver behind: it must be shut down
            raise self.errors.pop(0)
        self.up = True

    def shutdown(self):
        self.shutdowns += 1
        self.up = False


@pytest.fixture
def fake(monkeypatch):
    def make(*errors):
        f = FakeRay(errors)
        for name in ("is_initialized", "init", "shutdown"):
            monkeypatch.setattr(ray, name, getattr(f, name))
        return f
    return make


def test_a_node_that_missed_rays_startup_wait_is_started_again(fake):
    f = fake(Exception("The current node timed out during startup. This could happen because ..."))
    said: list[str] = []
    flower_engine.start_ray({"num_cpus": 2, "include_dashboard": False}, log=said.append)
    assert len(f.calls) == 2 and f.up and f.shutdowns == 1
    assert all(c["num_cpus"] == 2 and "PYTHONPATH" in c["runtime_env"]["env_vars"] for c in f.calls)
    assert said and "2 of 3" in said[0]


def test_other_errors_and_the_last_attempt_are_raised(fake):
    f = fake(RuntimeError("no such address"))
    with pytest.raises(RuntimeError, match="no such address"):
        flower_engine.start_ray({}, log=lambda m: None)
    assert len(f.calls) == 1 and not f.up
    timeout = Exception("The current node timed out during startup.")
    f = fake(timeout, timeout, timeout)
    with pytest.raises(Exception, match="timed out during startup"):
        flower_engine.start_ray({}, attempts=3, log=lambda m: None)
    assert len(f.calls) == 3 and not f.up and f.shutdowns == 3


def test_an_initialised_ray_is_left_as_it_is(fake):
    f = fake()
    f.up = True
    flower_engine.start_ray({"num_cpus": 2})
    assert f.calls == [] and f.shutdowns == 0
