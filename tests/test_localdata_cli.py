"""``fedswarm client --data BAD`` (and ``fedswarm peer``) refuse bad data at start: exit 2 and
one line naming the file and the problem, before any connection (the SuperLink address
127.0.0.1:1 has nothing behind it). The real commands run side by side, one process each."""

import subprocess
import sys

import numpy as np
import pytest

from tests.localdata_helpers import digits, write_csv, write_image_folder, write_npz

pytestmark = pytest.mark.timeout(300)


def _cases(tmp):
    x, y = digits(slice(0, 30))
    bad_label = y.copy()
    bad_label[4] = 12
    (tmp / "empty").mkdir()
    corrupt = write_image_folder(tmp / "corrupt", x[:10], y[:10])
    for f in corrupt.rglob("*.png"):
        f.write_bytes(b"\x89PNG\r\n not really")
    (tmp / "bad.csv").write_bytes(b"p0,label\n\xff\xfe,1\n")
    return {
        "shape": (write_npz(tmp / "shape.npz", x.reshape(30, 4, 16), y), "examples have shape (4, 16)"),
        "dtype": (write_npz(tmp / "dtype.npz", x.astype(np.complex64), y), "examples have dtype complex64"),
        "label": (write_npz(tmp / "label.npz", x, bad_label), "label 12 of example 4 is outside the task's classes"),
        "empty-folder": (tmp / "empty", "holds no examples"),
        "corrupt-images": (corrupt, "10 of 10 images cannot be used"),
        "unreadable-csv": (tmp / "bad.csv", "cannot read as CSV"),
        "empty-validation": (write_csv(tmp / "two.csv", x[:2], y[:2]), "leave an empty validation split"),
    }


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every bad case through the real ``fedswarm client`` (one through ``fedswarm peer``),
    all started at once; ``{case: (returncode, output, path, message)}``."""
    tmp = tmp_path_factory.mktemp("bad")
    cases = _cases(tmp)
    procs = {}
    for name, (path, _) in cases.items():
        cmd = [sys.executable, "-m", "fedswarm", "client", "--superlink", "127.0.0.1:1", "--insecure",
               "--data", str(path)]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    label_path = cases["label"][0]
    procs["peer-label"] = subprocess.Popen(
        [sys.executable, "-m", "fedswarm", "peer", "--data", str(label_path), "--insecure-allow-any",
         "--state-dir", str(tmp / "peer")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cases["peer-label"] = cases["label"]
    out = {}
    try:
        for name, p in procs.items():
            text, _ = p.communicate(timeout=240)
            out[name] = (p.returncode, text, *cases[name])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("case", ["shape", "dtype", "label", "empty-folder", "corrupt-images", "unreadable-csv",
                                  "empty-validation", "peer-label"])
def test_bad_data_stops_the_node_at_start_in_one_line(refused, case):
    code, text, path, message = refused[case]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert code == 2, text
    assert len(lines) == 1 and "Traceback" not in text, text
    assert lines[0].startswith(f"error: {path}") and message in lines[0], lines[0]


def test_good_data_goes_into_the_node_config(tmp_path):
    x, y = digits(slice(0, 50))
    path = write_npz(tmp_path / "mine.npz", x, y)
    res = subprocess.run([sys.executable, "-m", "fedswarm", "client", "--superlink", "127.0.0.1:1", "--insecure",
                          "--data", str(path), "--val-fraction", "0.1", "--dry-run"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert f"data: {path}: 45 training and 5 validation examples" in res.stderr
    assert f'data-path="{path}" label-column="label" val-fraction=0.1' in res.stdout
