"""An availability trace in the run config is read once per version of the file: every node's
message validates the run config again (fedswarm.local.run_config_of)."""

from __future__ import annotations

import os

import pytest

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError


def test_a_trace_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    import fedswarm.availability as availability

    reads = []
    real = availability.load_trace
    monkeypatch.setattr(availability, "load_trace", lambda path, n: reads.append(path) or real(path, n))
    trace = tmp_path / "trace.csv"
    trace.write_text("node,start_s,end_s\n0,0,100\n1,50,300\n")
    values = {"clients": 2, "devices": "edge-wifi:2", "availability": str(trace)}
    flat = RunConfig.build(values).to_flat()
    for _ in range(5):  # what each node's message does
        assert RunConfig.from_flat(dict(flat)).availability == str(trace)
    assert len(reads) == 1
    assert RunConfig.build({**values, "clients": 3, "devices": "edge-wifi:3"}).clients == 3  # another size: again
    assert len(reads) == 2

    trace.write_text("node,start_s,end_s\n0,0,100\n7,0,10\n")  # a new version of the file is checked again
    os.utime(trace, ns=(trace.stat().st_atime_ns, trace.stat().st_mtime_ns + 10**9))
    with pytest.raises(ConfigError, match="line 3: node 7 is not a partition id"):
        RunConfig.from_flat(dict(flat))
    with pytest.raises(ConfigError, match="line 3"):  # a refusal is never remembered as a pass
        RunConfig.from_flat(dict(flat))
    assert len(reads) == 4
    trace.unlink()
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_flat(dict(flat))
