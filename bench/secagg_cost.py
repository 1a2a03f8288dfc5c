"""A node's masking cost under SecAgg+ against serializing its plain update: the one measurement
``fedswarm bench secagg`` reports as ``mask_over_serialize`` (issue 44's target: at most 2x).

- **Serializing the plain update**: what a node's plain round does to put its update on the wire,
  from the reply's ``RecordDict`` holding its ``ArrayRecord`` (one float32 ``Array`` of ``d``
  values) to protobuf bytes: ``recorddict_to_proto(content).SerializeToString()``.
- **Masking**: everything the secure round adds before the same step for the masked vector: the
  quantizer's ``encode`` (clip, scale, stochastic rounding, wrap into the field), the node's
  ``masked_input`` stage (decrypting its neighbours' shares, agreeing one pair seed per neighbour,
  expanding and adding its self mask and ``degree`` pairwise masks) and the cast of the result
  into the wire word (uint32 for a 32-bit field). Building the ``Array`` and serializing it then
  cost what they cost for the plain update (both are 4-byte words), so they are left out of both.

Both are process CPU seconds of one node of an ``n``-node round at the bench's degree
(``default_degree(n)``) and field (32 bits), measured in one fresh interpreter, alternating
(serialize, encode, mask) ``reps`` times; the medians are reported. The cell also measures this
machine's AES-256-CTR keystream rate and so the floor no implementation of these masks can beat:
``(degree + 1) * 4 * (d + 1)`` keystream bytes per node.

``FEDSWARM_BENCH_BEFORE=CHECKOUT`` runs the same cell on another checkout's code (e.g. ``main``'s)
alternately with this one: the cell uses only what both have.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

__all__ = ["BEFORE_ENV", "before_checkout", "mask_cost", "mask_cost_before_after"]

BEFORE_ENV = "FEDSWARM_BENCH_BEFORE"

_CELL = r"""
import json, sys, time
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.serde import recorddict_to_proto
from fedswarm.algorithms.secagg import SecAggClient, SecAggParams, SecAggServer, default_degree, threshold_for
n, d, reps, weight, bits = (int(a) for a in sys.argv[1:6])
degree = min(n - 1, default_degree(n))
params = SecAggParams(threshold=threshold_for(degree + 1, 0.6), clip=1.0, bits=bits, weight_max=weight, degree=degree)
srv = SecAggServer(list(range(1, n + 1)), d, params, graph_seed=0)
cs = {i: SecAggClient(i) for i in srv.ids}
keys = {i: cs[i].advertise(m) for i, m in srv.setup().items()}
shares = {i: cs[i].share_keys(m) for i, m in srv.collect_keys(keys).items()}
node = srv.ids[0]
req = srv.collect_shares(shares)[node]
state = cs[node].to_state()
x = np.random.default_rng(1).normal(0.0, 0.1, d).astype(np.float32)
content = RecordDict({"arrays": ArrayRecord({"w": Array(x)})})
width = 4 if bits <= 32 else 8
zeros, buf = bytes(width * (d + 1)), bytearray(width * (d + 1))
clock = time.process_time
ser, enc_s, mask_s, aes = [], [], [], []
for r in range(reps + 1):  # the first pass warms up and is dropped
    t0 = clock()
    wire = recorddict_to_proto(content).SerializeToString()
    t1 = clock()
    c = SecAggClient(node, dict(state))
    enc = c.quantizer().encode(x, np.random.default_rng(r), weight=weight)
    t2 = clock()
    out = np.asarray(c.masked_input(req, enc))
    out = out.astype(np.uint32, copy=False) if bits <= 32 else out
    t3 = clock()
    Cipher(algorithms.AES(bytes(32)), modes.CTR(bytes(16))).encryptor().update_into(zeros, buf)
    t4 = clock()
    if r:
        ser.append(t1 - t0); enc_s.append(t2 - t1); mask_s.append(t3 - t2); aes.append(t4 - t3)
med = lambda v: float(np.median(v))
with open(sys.argv[6], "w") as fh:
    json.dump({"n": n, "d": d, "degree": degree, "bits": bits, "wire_bytes": len(wire),
               "serialize_s": ser, "encode_s": enc_s, "masked_input_s": mask_s, "aes_s": aes}, fh)
"""


def _run_cell(n: int, d: int, reps: int, weight: int, bits: int, pythonpath: Path | None, timeout_s: float) -> dict:
    from fedswarm.bench.cells import sampled_cell

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cell = sampled_cell(["-c", _CELL, str(n), str(d), str(reps), str(weight), str(bits), "{out}"], timeout_s, env=env)
    if "serialize_s" not in cell:
        raise RuntimeError(f"secagg mask-cost cell (n={n}, d={d}, code {pythonpath or 'this checkout'}) gave no "
                           f"figures: {cell.get('status')}: {cell.get('log', '')[-2000:]}")
    return cell


def _summary(cells: list[dict]) -> dict:
    """Medians over every rep of ``cells`` (same n, d), and the ratios the bench reports."""
    def med(key):
        return statistics.median(v for c in cells for v in c[key])

    c0 = cells[0]
    ser, enc, mask, aes = med("serialize_s"), med("encode_s"), med("masked_input_s"), med("aes_s")
    stream_bytes = (c0["degree"] + 1) * (4 if c0["bits"] <= 32 else 8) * (c0["d"] + 1)
    rate = (4 if c0["bits"] <= 32 else 8) * (c0["d"] + 1) / aes if aes > 0 else None
    floor = stream_bytes / rate if rate else None
    return {"degree": c0["degree"], "serialize_node_s": round(ser, 7), "encode_node_s": round(enc, 7),
            "masked_input_node_s": round(mask, 7), "mask_node_s": round(enc + mask, 7),
            "mask_over_serialize": round((enc + mask) / ser, 2) if ser > 0 else None,
            "keystream_bytes_per_node": stream_bytes,
            "aes_ctr_gb_per_s": round(rate / 1e9, 2) if rate else None,
            "aes_floor_node_s": round(floor, 7) if floor else None,
            "aes_floor_over_serialize": round(floor / ser, 2) if floor and ser > 0 else None,
            "mask_reps": sum(len(c["serialize_s"]) for c in cells)}


def mask_cost(n: int, d: int, *, reps: int = 7, weight: int = 10, bits: int = 32, timeout_s: float = 900) -> dict:
    """This checkout's masking cost of one node of an ``n``-node, ``d``-value round (module docstring)."""
    return _summary([_run_cell(n, d, reps, weight, bits, None, timeout_s)])


def mask_cost_before_after(n: int, d: int, before: Path, *, rounds: int = 3, reps: int = 5, weight: int = 10,
                           bits: int = 32, timeout_s: float = 900) -> dict:
    """The masking cost on ``before``'s code and on this checkout's, their cells alternating
    ``rounds`` times (so both see the same machine load); ``{"before": ..., "now": ...}``."""
    if not (before / "algorithms" / "secagg").is_dir():
        raise SystemExit(f"{BEFORE_ENV}={before}: not a fedswarm checkout with algorithms/secagg/")
    cells: dict[str, list[dict]] = {"before": [], "now": []}
    for _ in range(rounds):
        for arm, path in (("before", before), ("now", None)):
            cells[arm].append(_run_cell(n, d, reps, weight, bits, path, timeout_s))
    return {arm: _summary(v) for arm, v in cells.items()}


def before_checkout() -> Path | None:
    """The checkout ``FEDSWARM_BENCH_BEFORE`` names, if set."""
    env = os.environ.get(BEFORE_ENV)
    return Path(env).resolve() if env else None
