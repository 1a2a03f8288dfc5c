"""One GPU's figures, for ``scripts/gpu-check``: the batched engine on the GPU against the
same run on the CPU (in one process), and every codec's encode + decode beside a
device-to-device copy of the same bytes.

The engine case: FedAvg, iid, one local SGD step per client (batch 16, lr 0.3), every
client every round; the CPU run and the GPU run start from the same seed and must end
with the same model to ``ENGINE_RTOL``/``ENGINE_ATOL`` (``torch.allclose``; both in full
float32: TF32 is switched off for the comparison, else cuDNN's convolutions round to 10
mantissa bits). Throughput is client-rounds per second of the steady round (the median
round after the first); the peak is ``torch.cuda.max_memory_allocated`` over the run. The
fraction of the GPU's peak divides the round's work, counted analytically
(:func:`round_work`), by the steady round's time and by the device's vendor figure
(:data:`PEAKS`): FLOP/s or memory bandwidth, whichever bounds the round (its arithmetic
intensity against the device's ridge point).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["PEAKS", "TARGETS", "ENGINE_RTOL", "ENGINE_ATOL", "device_peak", "round_work", "engine_case",
           "engine_figures", "codec_figures", "full_fp32"]

#: The same final model on CPU and GPU, to this tolerance (float32 sums in another order:
#: three rounds of one step each move a weight by ~0.3 * |g|, and reordering a sum of ~10^3
#: float32 terms changes it by ~10^-6 relative; 10^-4 leaves room and still catches a wrong step).
ENGINE_RTOL, ENGINE_ATOL = 1e-4, 1e-5

#: Vendor peaks, dense FP32 on the CUDA cores (TF32 is off in these runs) and HBM bandwidth.
#: NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100, "H100 SXM / H100 NVL" table;
#: H100 PCIe from the H100 PCIe product brief PB-11133): SXM 67 TFLOPS FP32, 3.35 TB/s;
#: PCIe 51 TFLOPS, 2.0 TB/s; NVL 60 TFLOPS, 3.9 TB/s. NVIDIA H200 datasheet
#: (nvidia.com/en-us/data-center/h200): SXM 67 TFLOPS, 4.8 TB/s; NVL 60 TFLOPS, 4.8 TB/s.
#: Matched on ``torch.cuda.get_device_name`` in this order (the first key contained wins).
PEAKS: dict[str, dict] = {
    "H200 NVL": {"flops": 60e12, "bytes_per_s": 4.8e12, "source": "NVIDIA H200 datasheet (H200 NVL)"},
    "H200": {"flops": 67e12, "bytes_per_s": 4.8e12, "source": "NVIDIA H200 datasheet (H200 SXM)"},
    "H100 NVL": {"flops": 60e12, "bytes_per_s": 3.9e12, "source": "NVIDIA H100 datasheet (H100 NVL)"},
    "H100 PCIe": {"flops": 51e12, "bytes_per_s": 2.0e12, "source": "NVIDIA H100 PCIe product brief"},
    "H100": {"flops": 67e12, "bytes_per_s": 3.35e12, "source": "NVIDIA H100 datasheet (H100 SXM, HBM3)"},
}

#: The issue's targets on one H100, printed beside the figures: client-rounds/s of the batched
#: engine on digits-mlp at 100,000 clients; codec encode+decode at d = 10^8 as a fraction of a
#: device-to-device copy of the same bytes (copy time / codec time).
TARGETS = {
    "engine": {"task": "digits-mlp", "clients": 100_000, "client_rounds_per_s": 1_000_000},
    "codecs": {"d": 10**8, "vs_copy": {"onebit": 0.5, "sign": 0.5, "topk": 0.25, "countsketch": 0.25}},
}

TASK = dict(partition="iid", local_steps=1, batch_size=16, lr=0.3, fraction=1.0, seed=0, strategy="fedavg",
            engine="batched")


def device_peak(name: str) -> dict | None:
    """The vendor peak of the device named ``name`` (``torch.cuda.get_device_name``), or None."""
    for key, peak in PEAKS.items():
        if key.lower() in name.lower():
            return {"match": key, **peak}
    return None


@contextmanager
def full_fp32():
    """Matmuls and cuDNN convolutions in full float32 (no TF32) inside the block."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def round_work(task_name: str, clients: int, batch_size: int = 16, seed: int = 0) -> dict:
    """The work of one FedAvg round of one local step per client, counted analytically.

    FLOPs: one training step's forward and backward (``fedswarm.tasks.staged.step_flops``,
    matmuls and convolutions) per example, times the examples the round trains (each client
    its ``min(batch, n_k)``; the batched engine does exactly one backward pass over them).
    Bytes, a lower bound on the memory traffic: the examples read, the parameters read twice
    (forward, backward) and the gradient written, and every activation written in the forward,
    read in the backward, its gradient written and read (4 touches)."""
    from fedswarm.config import RunConfig
    from fedswarm.sim.batched_trainer import _activations_per_example
    from fedswarm.tasks import get_task
    from fedswarm.tasks.partition import partition_offsets
    from fedswarm.tasks.staged import step_flops
    from fedswarm.train import task_data

    cfg = RunConfig(task=task_name, clients=clients, seed=seed, partition="iid")
    task, data = get_task(task_name), task_data(cfg)
    _, offsets = partition_offsets(data.train_y.numpy(), cfg.partition, clients, seed)
    examples = int(np.minimum(np.diff(offsets), batch_size).sum())
    model = task.model(seed)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    x1, y1 = data.train_x[:1], data.train_y[:1]
    flops_per_example = step_flops(model, task.objective, x1, y1)
    acts = _activations_per_example(model, x1)
    x_bytes = data.train_x[0].numel() * data.train_x.element_size() + data.train_y.element_size()
    nbytes = examples * (x_bytes + 4 * 4 * acts) + 3 * 4 * d
    return {"examples": examples, "d": d, "flops": flops_per_example * examples, "bytes": nbytes}


def engine_case(task_name: str, clients: int, rounds: int, device: str, local_steps: int = 1) -> dict:
    """Run the engine case on ``device`` in this process: the final model, the steady round
    (median after the first), client-rounds/s, and on a GPU the peak allocated memory.
    ``local_steps`` > 1 trains every client's own model (vmap) instead of the one-step
    shortcut (one backward pass over all the clients' examples)."""
    import fedswarm.sim.batched as batched
    from fedswarm.bench.engines import _round_figures, run_in_store
    from fedswarm.config import RunConfig

    cfg = RunConfig(task=task_name, clients=clients, rounds=rounds, device=device,
                    **{**TASK, "local_steps": local_steps})
    gpu = torch.device(device).type == "cuda"
    threads = torch.get_num_threads()
    if gpu:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # the batched engine keeps no checkpoint: the final model is the last one it evaluates
    evaluate_flat, seen = batched.evaluate_flat, []

    def keep(task, model, flat, *args, **kwargs):
        seen[:] = [flat.detach().to("cpu", torch.float32, copy=True)]
        return evaluate_flat(task, model, flat, *args, **kwargs)

    t0 = time.perf_counter()
    batched.evaluate_flat = keep
    try:
        with full_fp32():
            status, res, total = run_in_store(cfg, t0)
    finally:
        batched.evaluate_flat = evaluate_flat
        torch.set_num_threads(threads)  # run_engine pins the CPU's threads for its own run
    model = seen[0]
    walls = [r["wall_s"] for r in res["rounds"] if r["round"] > 0]
    out = {"task": task_name, "clients": clients, "device": device, "status": status, "model": model,
           **_round_figures(walls, total), "final_test_accuracy": res["summary"]["final_test_accuracy"]}
    out["client_rounds_per_s"] = clients / out["steady_round_s"] if out.get("steady_round_s") else None
    if gpu:
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def engine_figures(task_name: str, clients: int, rounds: int, device: str) -> dict:
    """The engine case on the CPU and on ``device``, compared: one row."""
    cpu = engine_case(task_name, clients, rounds, "cpu")
    dev = engine_case(task_name, clients, rounds, device)
    a, b = cpu.pop("model"), dev.pop("model")
    row = {"task": task_name, "clients": clients, "rounds": rounds, "device": device,
           "cpu_client_rounds_per_s": cpu["client_rounds_per_s"],
           "client_rounds_per_s": dev["client_rounds_per_s"],
           "speedup": (dev["client_rounds_per_s"] / cpu["client_rounds_per_s"]
                       if dev["client_rounds_per_s"] and cpu["client_rounds_per_s"] else None),
           "steady_round_s": dev["steady_round_s"], "cpu_steady_round_s": cpu["steady_round_s"],
           "first_round_s": dev["first_round_s"], "peak_gpu_mb": dev.get("peak_gpu_mb"),
           "status": dev["status"] if dev["status"] == cpu["status"] else f"cpu {cpu['status']}, {dev['status']}",
           "max_abs_diff": float((a - b).abs().max()), "rtol": ENGINE_RTOL, "atol": ENGINE_ATOL,
           "same_model": bool(torch.allclose(a, b, rtol=ENGINE_RTOL, atol=ENGINE_ATOL)),
           "final_test_accuracy": dev["final_test_accuracy"], "cpu_final_test_accuracy": cpu["final_test_accuracy"]}
    work = round_work(task_name, clients)
    row.update(work)
    peak = device_peak(torch.cuda.get_device_name(device)) if torch.device(device).type == "cuda" else None
    if peak is not None and row["steady_round_s"]:
        ridge = peak["flops"] / peak["bytes_per_s"]  # FLOP per byte where the two bounds meet
        bound = "flops" if work["flops"] / work["bytes"] >= ridge else "bandwidth"
        achieved = (work["flops"] if bound == "flops" else work["bytes"]) / row["steady_round_s"]
        row.update(bound=bound, peak_fraction=achieved / (peak["flops"] if bound == "flops" else peak["bytes_per_s"]),
                   peak_source=peak["source"])
    else:
        row.update(bound=None, peak_fraction=None,
                   peak_source="no vendor peak for this device" if torch.device(device).type == "cuda" else "cpu")
    target = TARGETS["engine"]
    if (task_name, clients) == (target["task"], target["clients"]):
        row["target_client_rounds_per_s"] = target["client_rounds_per_s"]
        row["meets_target"] = bool(row["client_rounds_per_s"] and row["client_rounds_per_s"]
                                   >= target["client_rounds_per_s"])
    return row


def codec_figures(device: str, sizes: list[int], *, repeats: int, budget_s: float) -> list[dict]:
    """Every codec's encode + decode on ``device`` (one client), beside a device-to-device
    copy of the same tensor (``vs_copy_`` = copy time / codec time, median of the paired
    runs), with the target of the issue where it names one (at d = 10^8)."""
    from fedswarm.bench.codecs import device_rows

    rows = device_rows(torch.device(device), sizes=sizes, clients=(1,), repeats=repeats, budget_s=budget_s)
    goal = TARGETS["codecs"]
    for r in rows:
        t = goal["vs_copy"].get(r["codec"]) if r["d"] == goal["d"] else None
        r["target_vs_copy_"] = t
        r["meets_target"] = None if t is None or r["vs_copy_"] is None else bool(r["vs_copy_"] >= t)
    return rows
