"""AD-PSGD's pairwise exchange over real sockets: both sides apply or neither, the pair's
sum is kept, and concurrent exchanges never deadlock (bipartite or not)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers import wait_until
from tests.swarm_helpers import make_peers, start_all, stop_all


def _set(p, x):
    with p.driver.lock:
        p.driver.state.x = x.clone()[None]


def _x(p):
    with p.driver.lock:  # waits for an exchange this peer is serving to settle
        return p.driver.state.x[0].clone()


@pytest.fixture
def pair(tmp_path):
    peers = make_peers(tmp_path, 2, algorithm="adpsgd")
    start_all(peers)
    view = peers[0].view()
    active = next(p for p in peers if p.driver.role(p.view())[0])
    passive = next(p for p in peers if p is not active)
    assert view.n == 2 and not passive.driver.role(passive.view())[0]
    yield active, passive
    stop_all(peers)


def test_exchange_applies_on_both_sides_or_neither(pair):
    a, b = pair
    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(a.d, generator=g), torch.randn(a.d, generator=g)
    a.driver.commit_timeout_s = b.driver.commit_timeout_s = 0.6

    def check_untouched(outcome, expected):
        assert outcome == expected
        assert torch.equal(_x(a), xa) and torch.equal(_x(b), xb)

    _set(a, xa)
    _set(b, xb)
    # the passive side is busy: refused at once, nothing applied
    with b.driver.lock:
        outcome = a.driver.exchange(b.id)
    check_untouched(outcome, "busy")
    # the initiator vanishes after the accept: the passive side times out and aborts
    a.driver.fault = "no_commit"
    check_untouched(a.driver.exchange(b.id), "aborted")
    # the commit would be late: the initiator aborts instead of half-applying
    a.driver.fault = "late_commit"
    check_untouched(a.driver.exchange(b.id), "aborted")
    a.driver.fault = None
    # the accept carries a bad model: validated, refused, aborted on both sides
    b.driver.fault = "nan_accept"
    check_untouched(a.driver.exchange(b.id), "aborted")
    assert a.verifier.drop_counts().get("invalid_payload") == 1
    b.driver.fault = None
    # the normal case: both hold the average, the sum is kept
    assert a.driver.exchange(b.id) == "ok"
    ya, yb = _x(a), _x(b)
    assert torch.equal(ya, yb)
    torch.testing.assert_close(ya + yb, xa + xb, rtol=0, atol=1e-5)
    assert b.driver.counts["served"] == 1 and b.driver.counts["aborted"] == 3


@pytest.mark.parametrize("n", [4, 3, 5])  # 4: even ring, active/passive split; 3, 5: odd rings, lower end initiates
def test_concurrent_exchanges_keep_the_sum_and_never_deadlock(tmp_path, n):
    peers = make_peers(tmp_path, n, algorithm="adpsgd")
    for p in peers:  # every peer is up: a connect or handshake must not time out on a starved 2-core
        p.transport.connect_timeout_s = 60.0  # machine (the default 3 s made one 'unreachable' at load ~20)
    start_all(peers)
    try:
        g = torch.Generator().manual_seed(n)
        for p in peers:
            _set(p, torch.randn(p.d, generator=g))
        total = sum(_x(p) for p in peers)
        roles = {p.id: p.driver.role(p.view()) for p in peers}
        # even ring: half the peers initiate; odd ring: all but the highest-indexed one
        assert sum(r[0] for r in roles.values()) == (n // 2 if n % 2 == 0 else n - 1)
        outcomes: list[str] = []

        def worker(p):
            # back to back, with no spread between attempts: the worst case for collisions
            active, partners = roles[p.id]
            for k in range(12):
                if active:
                    outcomes.append(p.driver.exchange(partners[k % len(partners)]))

        threads = [threading.Thread(target=worker, args=(p,)) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "exchanges deadlocked"
        assert set(outcomes) <= {"ok", "busy", "aborted"}
        # Among simultaneous requests one always finds its partner free (no all-"busy"
        # livelock), and every committed exchange is applied on both ends: the passive end
        # applies when the commit arrives, which may be just after the initiator returned.
        assert outcomes.count("ok") >= 1
        wait_until(lambda: sum(p.driver.counts["served"] for p in peers) >= outcomes.count("ok"), 10,
                   what="every committed exchange applied by its passive end")
        assert sum(p.driver.counts["served"] for p in peers) == outcomes.count("ok")
        torch.testing.assert_close(sum(_x(p) for p in peers), total, rtol=0, atol=1e-4)
    finally:
        stop_all(peers)


def test_every_swarm_driver_restores_its_checkpoint_state():
    """A restarted peer loads its driver's state (Peer.start): no driver may fall back to
    the base class's NotImplementedError (GossipDriver once lost its load_state_dict to a
    subclass inserted above it, and restarted gossip peers crashed)."""
    from fedswarm.swarm.adpsgd import ADPSGDDriver
    from fedswarm.swarm.drivers import Driver, GossipDriver, ScheduledDriver, SwarmMergeDriver
    from fedswarm.swarm.leader import LeaderDriver
    from fedswarm.swarm.squarm import SquarmDriver

    for cls in (GossipDriver, ScheduledDriver, SwarmMergeDriver, LeaderDriver, SquarmDriver, ADPSGDDriver):
        assert cls.load_state_dict is not Driver.load_state_dict, cls.__name__
        assert cls.state_dict is not Driver.state_dict or cls is SwarmMergeDriver, cls.__name__
