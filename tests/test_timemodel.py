"""The device/network time model and the virtual clock."""

from __future__ import annotations

import pytest

from fedswarm.timemodel import (
    BUILTIN_PROFILES,
    DeviceClass,
    Link,
    Profile,
    VirtualClock,
    compute_time_s,
    gossip_round_time_s,
    load_profiles,
    parse_devices,
    profiles_from_dict,
    sync_round_time_s,
    transfer_time_s,
)

P = BUILTIN_PROFILES


def test_builtin_profiles():
    assert {"datacenter", "edge-wifi", "edge-lte", "straggler", "gpu", "cpu"} <= set(P)
    assert P["straggler"].device.speed * 10 == pytest.approx(P["edge-wifi"].device.speed)
    assert P["gpu"].device.speed > P["cpu"].device.speed > P["edge-wifi"].device.speed
    assert P["edge-lte"].link.bandwidth_mbps < P["edge-wifi"].link.bandwidth_mbps
    for name, p in P.items():
        assert p.name == name and p.description


def test_compute_and_transfer_times():
    dev = DeviceClass("x", speed=200.0, memory_gb=1.0, gflops=10.0)
    assert compute_time_s(dev, samples=50) == pytest.approx(0.25)
    assert compute_time_s(dev, flops=5e9) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="exactly one"):
        compute_time_s(dev, samples=1, flops=1)
    with pytest.raises(ValueError, match="no gflops"):
        compute_time_s(DeviceClass("y", 1.0, 1.0), flops=1.0)
    link = Link(bandwidth_mbps=8.0, latency_ms=20.0)
    # 1 MB at 8 Mbit/s is 1 s, plus 20 ms latency
    assert transfer_time_s(link, 1_000_000) == pytest.approx(1.02)
    assert transfer_time_s(link, 0) == 0.0
    assert transfer_time_s(P["edge-lte"], 125_000) == pytest.approx(0.05 + 0.1)


def test_sync_round_time_is_the_slowest_client():
    edge, slow = P["edge-wifi"], P["straggler"]
    nbytes = 1_000_000
    t_edge = 2 * transfer_time_s(edge.link, nbytes) + compute_time_s(edge, samples=100)
    t_slow = 2 * transfer_time_s(slow.link, nbytes) + compute_time_s(slow, samples=100)
    assert sync_round_time_s([edge, edge], 100, nbytes, nbytes) == pytest.approx(t_edge)
    assert sync_round_time_s([edge, slow, edge], 100, nbytes, nbytes) == pytest.approx(t_slow)
    # per-client sample counts
    assert sync_round_time_s([edge, edge], [100, 300], 0, 0) == pytest.approx(3.0)
    assert sync_round_time_s([], 100, 1, 1) == 0.0


def test_sync_round_shares_the_server_link():
    gpu = P["datacenter"]
    server = Link(bandwidth_mbps=1000.0, latency_ms=0.0)
    one = sync_round_time_s([gpu], 0, 10_000_000, 0, server_link=server)
    ten = sync_round_time_s([gpu] * 10, 0, 10_000_000, 0, server_link=server)
    lat = gpu.link.latency_ms / 1e3
    assert one == pytest.approx(lat + 0.08)  # 80 Mbit at 1 Gbit/s
    assert ten == pytest.approx(lat + 0.8)  # ten downloads share it
    assert sync_round_time_s([gpu] * 10, 0, 10_000_000, 0) == pytest.approx(lat + 0.008)


def test_gossip_round_time_sends_share_the_uplink():
    edge = P["edge-wifi"]
    msg = 1_000_000
    ring = gossip_round_time_s([edge] * 4, [2] * 4, msg, samples=100)
    assert ring == pytest.approx(1.0 + edge.link.latency_ms / 1e3 + 2 * msg * 8 / 50e6)
    exp = gossip_round_time_s([edge] * 4, [3] * 4, msg, samples=100)
    assert exp > ring
    overlap = gossip_round_time_s([edge] * 4, [2] * 4, msg, samples=100, overlap=True)
    assert overlap == pytest.approx(1.0)  # compute (1 s) hides the 0.33 s of sending
    mixed = gossip_round_time_s([edge, P["straggler"]], [1, 1], msg, samples=100)
    assert mixed == pytest.approx(10.0 + transfer_time_s(edge.link, msg))
    with pytest.raises(ValueError, match="2 entries for 3 nodes"):
        gossip_round_time_s([edge] * 3, [1, 1], msg)


def test_parse_devices():
    assert parse_devices("edge-wifi", 3) == ["edge-wifi"] * 3
    assert parse_devices("gpu:2,edge-wifi:3", 5) == ["gpu"] * 2 + ["edge-wifi"] * 3
    assert parse_devices(" gpu:1 , straggler ", 4) == ["gpu"] + ["straggler"] * 3


@pytest.mark.parametrize(
    "spec, n, message",
    [
        ("gpu:4,edge-wifi:12", 20, "counts sum to 16 but there are 20 nodes"),
        ("gpu:4,edge-wifi:12", 10, "counts sum to 16 but there are 10 nodes"),
        ("tpu:2", 2, r"unknown profile 'tpu' \(available: cpu, datacenter"),
        ("gpu:two", 2, "count for 'gpu' must be an integer >= 1 \\(got 'two'\\)"),
        ("gpu:0,cpu", 2, "must be an integer >= 1"),
        ("gpu,cpu", 2, "only one profile may omit its count"),
        ("gpu:2,cpu", 2, "none left for 'cpu'"),
        ("gpu:1,gpu:1", 2, "listed twice"),
        ("gpu:1,", 2, "expected NAME or NAME:COUNT"),
        ("", 2, "expected NAME"),
    ],
)
def test_parse_devices_errors_are_clear(spec, n, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(spec, n)


def test_load_profiles_merges_over_builtins(tmp_path):
    f = tmp_path / "profiles.toml"
    f.write_text(
        '[edge-lte]\nbandwidth_mbps = 5\n\n'
        '[phone]\nbase = "edge-lte"\nspeed = 40\ndescription = "old phone"\n\n'
        '[lab]\nspeed = 1000\nmemory_gb = 32\nbandwidth_mbps = 100\nlatency_ms = 0.5\n'
    )
    prof = load_profiles(f)
    assert prof["edge-lte"].link.bandwidth_mbps == 5.0
    assert prof["edge-lte"].link.latency_ms == P["edge-lte"].link.latency_ms  # untouched key
    assert prof["phone"].device.speed == 40.0 and prof["phone"].link.bandwidth_mbps == 5.0
    assert prof["phone"].description == "old phone"
    assert prof["lab"].device.memory_gb == 32.0 and prof["lab"].device.gflops is None
    assert prof["gpu"] == P["gpu"]
    assert P["edge-lte"].link.bandwidth_mbps == 10.0  # built-ins are not modified
    assert parse_devices("phone:2,lab:1", 3, prof) == ["phone", "phone", "lab"]
    nested = tmp_path / "nested.toml"
    nested.write_text("[profiles.cpu]\nspeed = 7\n")
    assert load_profiles(nested)["cpu"].device.speed == 7.0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"edge-lte": {"bandwith_mbps": 5}}, r"unknown profile key 'edge-lte.bandwith_mbps'"),
        ({"edge-lte": {"latency_ms": -1}}, r"'edge-lte.latency_ms' must be a finite number >= 0"),
        ({"gpu": {"speed": 0}}, r"'gpu.speed' must be a finite number > 0"),
        ({"gpu": {"speed": "fast"}}, r"'gpu.speed' must be a number"),
        ({"gpu": {"memory_gb": True}}, r"'gpu.memory_gb' must be a number"),
        ({"new": {"speed": 1}}, r"new profile 'new' is missing key 'new.memory_gb'"),
        ({"new": {"base": "nope"}}, r"'new.base' names unknown profile 'nope'"),
        ({"bad name": {"base": "gpu"}}, "profile name"),
        ({"gpu": 3}, "must be a table"),
    ],
)
def test_bad_profiles_name_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        profiles_from_dict(data)


def test_load_profiles_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_profiles(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[gpu\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_profiles(bad)


def test_virtual_clock_orders_events():
    clock = VirtualClock()
    for t, e in [(3.0, "c"), (1.0, "a"), (2.0, "b1"), (2.0, "b2"), (2.0, "b3"), (0.5, "first")]:
        clock.schedule(t, e)
    assert clock.peek_time() == 0.5 and len(clock) == 6
    out = []
    while clock:
        t, e = clock.pop()
        assert clock.now == t
        out.append(e)
    assert out == ["first", "a", "b1", "b2", "b3", "c"]  # ties in insertion order
    assert clock.peek_time() is None
    with pytest.raises(IndexError):
        clock.pop()
    with pytest.raises(ValueError, match="in the past"):
        clock.schedule(1.0, "late")
    clock.schedule_in(0.5, "x")
    assert clock.pop() == (3.5, "x")
    with pytest.raises(ValueError):
        clock.schedule(float("nan"), "y")


def test_clock_is_deterministic_with_unorderable_events():
    clock = VirtualClock()
    clock.schedule(1.0, {"a": 1})
    clock.schedule(1.0, {"b": 2})  # dicts do not compare: ties must never reach them
    assert clock.pop()[1] == {"a": 1}


def test_ten_times_slower_node_makes_ten_times_fewer_steps():
    """Asynchronous workers, each looping on its own compute time, on one clock."""
    nodes = {"fast": P["edge-wifi"], "slow": P["straggler"]}
    batch = 32
    clock = VirtualClock()
    steps = {name: 0 for name in nodes}
    for name, prof in nodes.items():
        clock.schedule_in(compute_time_s(prof, samples=batch), name)
    horizon = 100 * compute_time_s(P["straggler"], samples=batch)  # 320 s
    while clock and clock.peek_time() <= horizon + 1e-9:
        _, name = clock.pop()
        steps[name] += 1
        clock.schedule_in(compute_time_s(nodes[name], samples=batch), name)
    assert steps == {"fast": 1000, "slow": 100}


def test_profile_is_a_plain_value():
    p = Profile("x", DeviceClass("x", 1.0, 1.0), Link(1.0, 0.0))
    assert p == Profile("x", DeviceClass("x", 1.0, 1.0), Link(1.0, 0.0))
