"""Device telemetry: the /proc and /sys readers on a fake file system tree, absent
sources left out (never guessed), the record's bytes counted apart from the training bytes,
and a node's row carrying its telemetry."""

from __future__ import annotations

import itertools

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.telemetry import TELEMETRY_KEYS, battery, cpu_model, cpu_temp_c, peak_rss_mb, round_telemetry


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def laptop(tmp_path):
    """A laptop on battery: /proc and /sys as the kernel writes them."""
    _write(tmp_path / "proc/self/status", "Name:\tpython\nVmPeak:\t 900000 kB\nVmHWM:\t  524288 kB\nVmRSS:\t 1 kB\n")
    _write(tmp_path / "proc/cpuinfo", "processor\t: 0\nmodel name\t: Test CPU 9000\n\nprocessor\t: 1\n"
                                      "model name\t: Test CPU 9000\n")
    ps = tmp_path / "sys/class/power_supply"
    _write(ps / "AC/type", "Mains\n")
    _write(ps / "AC/online", "0\n")
    _write(ps / "BAT0/type", "Battery\n")
    _write(ps / "BAT0/capacity", "87\n")
    th = tmp_path / "sys/class/thermal"
    _write(th / "thermal_zone0/type", "iwlwifi_1\n")
    _write(th / "thermal_zone0/temp", "33000\n")
    _write(th / "thermal_zone1/type", "x86_pkg_temp\n")
    _write(th / "thermal_zone1/temp", "61500\n")
    return tmp_path


def test_readers_on_a_fake_laptop(laptop):
    assert peak_rss_mb(laptop) == 512.0  # VmHWM, not VmPeak or VmRSS
    assert cpu_model(laptop) == "Test CPU 9000"
    assert battery(laptop) == {"battery_pct": 87.0, "power_source": "battery"}
    assert cpu_temp_c(laptop) == 61.5  # the CPU's zone, not the wifi card's
    _write(laptop / "sys/class/power_supply/AC/online", "1\n")
    assert battery(laptop)["power_source"] == "ac"


def test_a_raspberry_pi_reports_its_board_and_soc_temperature(tmp_path):
    _write(tmp_path / "proc/cpuinfo", "processor\t: 0\nBogoMIPS\t: 108.00\n\nHardware\t: BCM2835\n"
                                      "Model\t\t: Raspberry Pi 4 Model B Rev 1.4\n")
    _write(tmp_path / "sys/class/thermal/thermal_zone0/type", "cpu-thermal\n")
    _write(tmp_path / "sys/class/thermal/thermal_zone0/temp", "48686\n")
    assert cpu_model(tmp_path) == "Raspberry Pi 4 Model B Rev 1.4"
    assert cpu_temp_c(tmp_path) == 48.7
    assert battery(tmp_path) == {}  # no power_supply class at all


def test_missing_sources_are_absent_never_guessed(tmp_path):
    _write(tmp_path / "sys/class/thermal/thermal_zone0/type", "iwlwifi_1\n")  # no CPU zone
    _write(tmp_path / "sys/class/thermal/thermal_zone0/temp", "33000\n")
    _write(tmp_path / "sys/class/power_supply/AC/type", "Mains\n")  # a desktop: mains, no battery
    _write(tmp_path / "sys/class/power_supply/AC/online", "1\n")
    tel = round_telemetry(2.0, 500, root=tmp_path)
    assert tel["train_s"] == 2.0 and tel["examples_per_s"] == 250.0
    assert tel["power_source"] == "ac"
    for key in ("peak_rss_mb", "cpu_model", "battery_pct", "cpu_temp_c"):
        assert key not in tel, key
    assert set(tel) <= set(TELEMETRY_KEYS)
    assert "examples_per_s" not in round_telemetry(1.0, 0, root=tmp_path)  # nothing counted: no speed
    _write(tmp_path / "proc/self/status", "Name:\tpython\nVmHWM:\tgarbage kB\n")
    assert peak_rss_mb(tmp_path) is None


@pytest.mark.parametrize("ds", [[1, 20], range(4010, 4050, 3), [524_200, 524_220, 524_240]])
def test_telemetry_bytes_are_exactly_what_the_record_adds(ds):
    """The grid's cheap count (no second serialization of the model) equals the serialized
    difference, also where the telemetry makes the content's length need one more varint byte
    (16384 and 2**21 bytes: d = 4015..4043 and 524208..524232 cross); the training bytes stay."""
    for d in ds:
        _one_size(d)


def _one_size(d: int) -> None:
    from fedswarm.protocol import TELEMETRY_RECORD
    from fedswarm.server.metered_grid import MeteredGrid, record_size, serialized_size
    from fedswarm.wire import vector_to_arrayrecord

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0

    def reply(with_telemetry: bool) -> Message:
        content = RecordDict({"arrays": vector_to_arrayrecord(torch.zeros(d)), "metrics": MetricRecord({"n": 1})})
        if with_telemetry:
            content[TELEMETRY_RECORD] = ConfigRecord({"train_s": 0.25, "cpu_model": "x" * 40, "cpu_count": 4})
        return Message(content, 3, "train")

    plain, told = reply(False), reply(True)
    assert record_size(told, TELEMETRY_RECORD) == serialized_size(told) - serialized_size(plain) > 0
    assert record_size(plain, TELEMETRY_RECORD) == 0

    class Echo:
        def send_and_receive(self, messages, timeout=None):
            return [told for _ in messages]

    grid = MeteredGrid(Echo())
    grid.send_and_receive([plain])
    t = grid.take()
    assert t.bytes_up == serialized_size(plain) and t.telemetry_up == serialized_size(told) - serialized_size(plain)
    assert t.report_up == 0


def test_each_node_row_carries_its_telemetry(tmp_path, monkeypatch):
    import fedswarm.sim.inprocess as inprocess
    from fedswarm.config import RunConfig
    from fedswarm.sim.run import run_engine
    from fedswarm.store import Store

    monkeypatch.setattr(inprocess, "_run_ids", itertools.repeat(1))
    cfg = RunConfig(task="digits-mlp", clients=2, rounds=1, seed=1, local_steps=3, batch_size=8)
    store = Store(tmp_path / "t.db")
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    rows = [n for n in store.node_rounds(rid) if n.round == 1]
    assert len(rows) == 2
    for row in rows:
        tel = row.telemetry
        assert set(tel) <= set(TELEMETRY_KEYS) and tel["train_s"] > 0
        # 3 local steps of 8 examples were processed in train_s seconds
        assert tel["examples_per_s"] == pytest.approx(24 / tel["train_s"], rel=1e-3)
        assert tel["cpu_count"] >= 1 and tel["peak_rss_mb"] > 10
    result = store.export_result(rid)
    assert result["rounds"][1]["bytes_telemetry"] > 0
    assert {n["node_id"] for n in result["node_rounds"] if n["round"] == 1} == {r.node_id for r in rows}
    store.close()
