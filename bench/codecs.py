"""Codec throughput: encode + decode speed of every codec beside a plain memory copy.

For d = 10^6 and 10^7 float32 parameters (quick: 10^6 only) and K = 1 and K = 64 clients,
each codec's ``decode(encode(x), out=buf)`` is timed (decoding into one preallocated
output buffer, reused every run, as the batched engine decodes into its round's buffer;
median of up to 9 runs, 15 in the full mode, after a warm-up that also builds cached
tables such as Count Sketch hashes; cells whose runs would take long get fewer, at least
one) and reported in MB of float32
input per second, beside two memory copies of the same tensor, each run interleaved
with the codec's (copy, codec, copy, codec, ...; the ratios are medians of the per-pair
ratios, robust to a load that changes during the run):
``memcpy`` = ``x.clone()`` (a fresh tensor: torch's allocator hands out 4 KB pages, so
this pays ~10,000 page faults at 40 MB; ``vs memcpy``) and ``copy_`` = a copy into a warm
preallocated tensor (pure memory bandwidth, ``vs copy_``: the stricter figure, and the one
the codec speed targets are held to). A VM's copy speed can swing between runs (6-15 GB/s
at 40 MB on one 2-core cloud VM, minutes apart) while a codec bound by cache or compute
moves less, so compare ``vs copy_`` across several runs. On a CPU the benchmark runs on
ONE thread (``torch.set_num_threads(1)``, restored afterwards). On a GPU (``--device cuda``)
each run is timed with CUDA events, ``copy_`` is a device-to-device copy, and the same cells
run on the CPU first so both devices' rows sit side by side. Bytes on the wire are
measured on a serialized Flower message of one client's payload.

    python -m fedswarm.bench.codecs --quick --out out/   # or: fedswarm bench codecs
    python -m fedswarm.bench.codecs --d 1e7 --clients 1 --out out/   # one cell per codec, < 2 min
    python -m fedswarm.bench.codecs --sketch-profile --d 1e7 --out out/   # where Count Sketch's time goes

On a CPU the hot loops are the C kernels of :mod:`fedswarm.algorithms.compression.native`
when a C compiler is there (``FEDSWARM_NATIVE=0`` times the eager numpy/torch code).

Writes ``OUT/codecs.json`` (the rows), ``OUT/codecs.png`` (bar chart) and prints a table.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from collections.abc import Callable, Sequence

import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.codecs import CODECS, make_codec
from fedswarm.wire import message_nbytes, payload_to_records

__all__ = ["run", "device_rows", "benchmark_layout", "sketch_profile"]

_MEMORY_LIMIT = 4 * 2**30  # skip a (d, K) cell whose working set would exceed ~4 GB
_WORKING_SET = 5  # input + output + codec temporaries, in multiples of the input size


def benchmark_layout(d: int, width: int = 512) -> ParamLayout:
    """An MLP-like layout of exactly d parameters: ``[width, width]`` weights with their
    biases, then one last ``[rows, width]`` matrix and a vector for the remainder (76
    tensors at d = 10^7, about as many as a ResNet-18)."""
    shapes, total, n = [], 0, 0
    while total + width * width + width <= d:
        shapes += [(f"layer{n}.weight", (width, width)), (f"layer{n}.bias", (width,))]
        total, n = total + width * width + width, n + 1
    rows = (d - total) // width
    if rows:
        shapes.append((f"layer{n}.weight", (rows, width)))
        total += rows * width
    if d > total:
        shapes.append((f"layer{n}.bias", (d - total,)))
    return ParamLayout.from_shapes(shapes)


def _paired(fn: Callable[[], object], refs: dict[str, Callable[[], object]], device: torch.device, repeats: int,
            budget_s: float) -> tuple[tuple[float, float, int], dict[str, tuple[float, float, int]], dict[str, float]]:
    """Time ``fn`` interleaved with each reference (ref, fn, ref, fn, ...), so that both see
    the same machine load: ``(fn's (median, min, runs), each ref's (median, min, runs),
    each ref's median of the per-pair ratios ref_time / fn_time)``. The paired ratio is the
    figure of record on a loaded machine, where load changes between separate runs."""

    def once(f) -> float:
        if device.type == "cuda":  # CUDA events on the stream: the GPU's time from start to end, host gaps included
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            begin.record()
            f()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        start = time.perf_counter()
        f()
        return time.perf_counter() - start

    first = once(fn)  # warm-up: builds cached tables
    for ref in refs.values():
        once(ref)
    n = max(1, min(repeats, int(budget_s / max(first, 1e-9))))
    times, ref_times = [], {name: [] for name in refs}
    ratios = {name: [] for name in refs}
    for _ in range(n):
        for name, ref in refs.items():
            r = once(ref)
            t = once(fn)
            ref_times[name].append(r)
            ratios[name].append(r / t)
            times.append(t)
    stat = (statistics.median(times), min(times), len(times))
    ref_stat = {name: (statistics.median(v), min(v), len(v)) for name, v in ref_times.items()}
    return stat, ref_stat, {name: statistics.median(v) for name, v in ratios.items()}


def _roundtrip(codec, x: torch.Tensor, layout: ParamLayout, out: torch.Tensor) -> Callable[[], object]:
    return lambda: codec.decode(codec.encode(x, layout, seed=1), layout, out=out)


def _message_bytes(payload) -> int:
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # Message() needs one
    try:
        return message_nbytes(Message(payload_to_records(payload), dst_node_id=1, message_type="train"))
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _row(codec: str, d: int, k: int, dev: torch.device, wire: int, note: str, timing=None, copy=None,
         ratios=None) -> dict:
    """One table row; ``timing`` and ``copy`` are (median, min, runs) of the codec and of
    the memory copy (timed interleaved with it), ``ratios`` the paired median ratios
    ``{"memcpy": .., "copy_": ..}``; None for a skipped cell."""
    row = {
        "codec": codec,
        "d": d,
        "K": k,
        "device": str(dev),
        "wire_bytes": wire,
        "compression": 4 * d / wire,
        "note": note,
    }
    mb = 4 * k * d / 1e6
    if timing is None:
        return {
            **row,
            "mb_per_s": None,
            "vs_memcpy": None,
            "ms": None,
            "best_mb_per_s": None,
            "best_vs_memcpy": None,
            "vs_copy_": None,
            "best_ms": None,
            "runs": 0,
        }
    (t, t_min, runs), (_, c_min, _) = timing, copy
    return {
        **row,
        "mb_per_s": mb / t,
        "vs_memcpy": ratios["memcpy"],
        "ms": 1e3 * t,
        "best_mb_per_s": mb / t_min,
        "best_vs_memcpy": c_min / t_min,
        "vs_copy_": ratios["copy_"],
        "best_ms": 1e3 * t_min,
        "runs": runs,
    }


def run(out_dir: Path, quick: bool = False, device: str = "cpu", *, sizes: Sequence[int] | None = None,
        clients: Sequence[int] = (1, 64), beside_cpu: bool = True) -> list[dict]:
    """Run the benchmark, write ``out_dir/codecs.json`` and ``out_dir/codecs.png``, print a
    table, and return the rows. ``sizes`` overrides the values of d, ``clients`` those of K.
    On a GPU (``device`` cuda or cuda:N, checked to exist) the same cells run on the CPU
    first, so both devices' rows sit side by side (``beside_cpu=False``: the GPU's only)."""
    from fedswarm.train import check_node_device

    dev = check_node_device(device)
    rows: list[dict] = []
    for d in ([torch.device("cpu")] if dev.type != "cpu" and beside_cpu else []) + [dev]:
        rows += device_rows(d, quick, sizes, clients)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "codecs.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out_dir / "codecs.png")
    _print(rows)
    return rows


def device_rows(dev: torch.device, quick: bool = False, sizes: Sequence[int] | None = None,
                clients: Sequence[int] = (1, 64), *, repeats: int | None = None,
                budget_s: float | None = None) -> list[dict]:
    """The rows of one device (a CPU runs on one thread: the targets are per core)."""
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _run(quick, dev, sizes, clients, repeats, budget_s)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool, dev: torch.device, sizes: Sequence[int] | None, clients: Sequence[int],
         repeats: int | None, budget_s: float | None) -> list[dict]:
    sizes = list(sizes) if sizes else [10**6] if quick else [10**6, 10**7]
    default_repeats, default_budget = (9, 1.5) if quick else (15, 10.0)
    repeats, budget_s = repeats or default_repeats, budget_s or default_budget
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for d in sizes:
        layout = benchmark_layout(d)
        x1 = torch.randn(1, d, generator=gen).to(dev)
        wire = {name: _message_bytes(make_codec(name).encode(x1, layout, seed=1)) for name in CODECS}
        wire["memcpy"] = 4 * d
        notes = {"memcpy": "x.clone()", "copy_": "warm.copy_(x)",
                 **{name: make_codec(name).summary() for name in CODECS}}
        wire["copy_"] = 4 * d
        for k in clients:
            need = _WORKING_SET * 4 * k * d
            if need > _MEMORY_LIMIT:
                note = f"skipped: needs ~{need / 2**30:.0f} GB (limit {_MEMORY_LIMIT / 2**30:.0f} GB)"
                rows += [_row(n, d, k, dev, wire[n], note) for n in notes]
                continue
            x = x1.expand(k, d) + 0.01 * torch.randn(k, d, generator=gen).to(dev)  # clients differ
            buf, buf2 = torch.empty_like(x), torch.empty_like(x)  # the copy's and the decoders' outputs
            refs = {"memcpy": lambda x=x: x.clone(), "copy_": lambda x=x, buf=buf: buf.copy_(x)}
            cells = {"memcpy": refs["memcpy"], "copy_": refs["copy_"]}
            cells.update({name: _roundtrip(make_codec(name), x, layout, buf2) for name in CODECS})
            for name, fn in cells.items():
                timing, ref_timing, ratios = _paired(fn, refs, dev, repeats, budget_s)
                rows.append(_row(name, d, k, dev, wire[name], notes[name], timing, ref_timing["memcpy"], ratios))
            x = buf = buf2 = None  # free the batch before the next one is made
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="codec encode+decode throughput, MB/s of float32 input (median; best of the runs)")
    cols = (
        "codec",
        "device",
        "d",
        "K",
        "MB/s",
        "vs memcpy",
        "best MB/s",
        "best vs memcpy",
        "vs copy_",
        "wire B/client",
        "compression",
        "note",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("codec", "note") else "right")
    for r in rows:
        table.add_row(
            r["codec"],
            r["device"],
            f"{r['d']:.0e}",
            str(r["K"]),
            _fmt(r["mb_per_s"], ",.0f"),
            _fmt(r["vs_memcpy"], ".3f"),
            _fmt(r["best_mb_per_s"], ",.0f"),
            _fmt(r["best_vs_memcpy"], ".3f"),
            _fmt(r.get("vs_copy_"), ".3f"),
            f"{r['wire_bytes']:,}",
            f"{r['compression']:.1f}x",
            r["note"],
        )
    Console(width=200).print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["device"], r["d"], r["K"]) for r in rows if r["mb_per_s"] is not None})
    fig, axes = plt.subplots(1, max(1, len(cells)), figsize=(4.5 * max(1, len(cells)), 4), squeeze=False)
    for ax, (device, d, k) in zip(axes[0], cells, strict=True):
        sel = [r for r in rows if (r["device"], r["d"], r["K"]) == (device, d, k) and r["mb_per_s"] is not None]
        names = [r["codec"] for r in sel]
        ax.bar(names, [r["mb_per_s"] for r in sel],
               color=["grey" if n in ("memcpy", "copy_") else "tab:blue" for n in names])
        ax.set_yscale("log")
        ax.set_title(f"{device}, d = {d:.0e}, K = {k}")
        ax.set_ylabel("MB/s of float32 input")
        ax.tick_params(axis="x", labelrotation=60)
    fig.suptitle("encode + decode throughput vs memory copy (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sketch_profile(out_dir: Path, d: int = 10**7, repeats: int = 9) -> list[dict]:
    """Where the Count Sketch codec's encode + decode time goes, one client on one thread,
    each step timed interleaved with a warm copy of the same vector (``vs copy_``, the
    median of the per-pair ratios): the whole encode (the C kernel ``fs_sketch``), the
    same kernel with no rows (x read in order and its 64-byte lines stored permuted into
    y, block by block: the stream of x alone), the same encode storing single floats
    through pi instead of whole lines (what y would cost if pi had no line structure),
    and the decode (``unsketch``, the top-k). Needs the C kernels. Writes
    ``OUT/countsketch_profile.json``."""
    from fedswarm.algorithms.compression import countsketch_native, native
    from fedswarm.algorithms.compression.sparse import CountSketchCodec, _sketcher

    so = native.lib()
    if so is None:
        raise SystemExit("--sketch-profile times the C kernels: no C compiler was found (or FEDSWARM_NATIVE=0)")
    codec = CountSketchCodec()
    rows, cols, k = codec._dims(d, codec.params)
    sk = _sketcher(d, rows, cols, 1, torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(1, d, generator=torch.Generator().manual_seed(0))
        warm, table = torch.empty_like(x), torch.zeros(rows, cols)

        def kernel(r: int, by_lines: bool):
            ptrs, ybuf = countsketch_native.sketch_args(sk, by_lines)
            return lambda: so.fs_sketch(native.ptr(x), d, cols, r, sk.blocks, *ptrs, native.ptr(table),
                                        native.ptr(ybuf))

        enc = sk.sketch(x)
        for by_lines in (True, False):  # the profiled kernel is the codec's: same table, before the bucket signs
            table.zero_()
            kernel(rows, by_lines)()
            if not torch.equal(table * sk.bucket_signs.float(), enc[0]):
                raise AssertionError("the profiled fs_sketch call does not reproduce the codec's table")
        steps = {
            "encode (fs_sketch, all rows)": kernel(rows, True),
            "encode with no rows (stream of x, lines into y)": kernel(0, True),
            "encode storing single floats (through pi, no lines)": kernel(rows, False),
            "decode (unsketch: estimates, top-k)": lambda: sk.unsketch(enc, k),
        }
        out = []
        for name, fn in steps.items():
            (med, best, n), ref, ratio = _paired(fn, {"copy_": lambda: warm.copy_(x)}, torch.device("cpu"), repeats,
                                                 10.0)
            out.append({"step": name, "d": d, "rows": rows, "cols": cols, "k": k, "ms": 1e3 * med,
                        "best_ms": 1e3 * best, "copy_ms": 1e3 * ref["copy_"][0], "vs_copy_": ratio["copy_"], "runs": n})
    finally:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "countsketch_profile.json").write_text(json.dumps(out, indent=1))
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Count Sketch, d = {d:.0e}, r = {rows}, c = {cols}, k = {k}: one client, one thread (median)")
    for col in ("step", "ms", "copy_ ms", "vs copy_"):
        t.add_column(col, justify="left" if col == "step" else "right")
    for r in out:
        t.add_row(r["step"], f"{r['ms']:.2f}", f"{r['copy_ms']:.2f}", f"{r['vs_copy_']:.3f}")
    Console().print(t)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fedswarm.bench.codecs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench"), help="writes DIR/codecs.json and DIR/codecs.png")
    parser.add_argument("--quick", action="store_true", help="d = 10^6 only, fewer runs")
    parser.add_argument("--d", type=float, action="append", metavar="D",
                        help="a value of d (repeatable; default 1e6 and 1e7, quick: 1e6)")
    parser.add_argument("--clients", type=int, action="append", metavar="K",
                        help="a value of K (repeatable; default 1 and 64)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda or cuda:N; a GPU's rows come "
                                                        "beside the CPU's)")
    parser.add_argument("--sketch-profile", action="store_true",
                        help="instead: time Count Sketch's steps (encode, the same with no rows, encode storing "
                             "single floats instead of lines, decode) beside a warm copy, at the first --d (default "
                             "1e7), one client")
    args = parser.parse_args(argv)
    sizes = None
    if args.d:
        if any(v < 1 or v != int(v) for v in args.d):
            parser.error(f"--d must be a positive integer, got {args.d}")
        sizes = [int(v) for v in args.d]
    if args.clients and any(k < 1 for k in args.clients):
        parser.error(f"--clients must be >= 1, got {args.clients}")
    if args.sketch_profile:
        sketch_profile(args.out, d=sizes[0] if sizes else 10**7)
        return
    run(args.out, quick=args.quick, device=args.device, sizes=sizes, clients=args.clients or (1, 64))


if __name__ == "__main__":
    main()
