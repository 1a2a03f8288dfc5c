"""The CUDA paths: the batched engine, the codecs and the memory budget on a GPU against
the CPU (``@pytest.mark.cuda``: skipped without CUDA, run by ``scripts/gpu-check``), and the
one-line refusal of ``--device cuda`` where there is no CUDA (runs everywhere: the commands
run with ``CUDA_VISIBLE_DEVICES=""``, so a GPU machine checks it too).

Tolerances: codec arrays that are integers or bits (indices, sign bits, packed codes) must be
equal bit for bit; float arrays that are sums (1-bit's scales, sign's scale, the Count Sketch
table, QSGD's norms) are summed in another order on the GPU: ``rtol = 1e-5`` of the largest
magnitude. QSGD's random rounding draws from the device's generator (Philox on CUDA,
Mersenne Twister on the CPU), so its codes may differ by one level, never more."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedswarm.algorithms.compression.codecs import CODECS, make_codec
from fedswarm.bench.codecs import benchmark_layout
from fedswarm.errors import ConfigError
from fedswarm.train import check_node_device

ROOT = Path(__file__).resolve().parents[1]
GPU = os.environ.get("FEDSWARM_GPU_DEVICE", "cuda")  # scripts/gpu-check --device passes its own
FLOAT_RTOL = 1e-5


def _no_cuda_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def _one_line_error(done: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    assert done.returncode == code, done.stdout + done.stderr
    assert len(lines) == 1, lines
    assert all(n in lines[0] for n in needles), lines[0]


# -- --device cuda without CUDA: one line, everywhere ------------------------------------------

@pytest.mark.parametrize("command", [
    ["sim", "--device", "cuda", "--clients", "2", "--rounds", "1"],
    ["client", "--superlink", "127.0.0.1:1", "--insecure", "--device", "cuda", "--dry-run"],
    ["bench", "codecs", "--device", "cuda"],
])
def test_cuda_asked_without_cuda_is_one_line(command, tmp_path):
    args = [*command, "--db", str(tmp_path / "x.db")] if command[0] == "sim" else command
    if command[0] == "bench":
        args = [*command, "--out", str(tmp_path)]
    done = _no_cuda_run(sys.executable, "-m", "fedswarm", *args)
    _one_line_error(done, 2, "cuda", "CUDA is not available")
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "codecs.json").exists()  # refused before work


def test_gpu_check_without_cuda_is_one_line(tmp_path):
    done = _no_cuda_run(sys.executable, str(ROOT / "scripts" / "gpu-check"), "--out", str(tmp_path))
    _one_line_error(done, 2, "gpu-check", "CUDA is not available")
    assert not any(tmp_path.iterdir())


def test_node_device_checked_in_one_line():
    assert check_node_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^invalid value for '--device': must be auto, cpu, mps, cuda or cuda:N "
                                          r"\(got 'gpu0'\)$"):
        check_node_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            check_node_device("cuda:0")
    else:
        with pytest.raises(ConfigError, match="CUDA device"):
            check_node_device(f"cuda:{torch.cuda.device_count()}")


def test_client_device_goes_to_the_node_config_and_overrides_the_run():
    from fedswarm.client.supernode import supernode_command
    from fedswarm.local import run_config_of

    cmd = supernode_command("127.0.0.1:1", 0, 2, device_class="cpu", insecure=True, device="cpu")
    assert 'device="cpu"' in cmd[cmd.index("--node-config") + 1]
    msg = Message(RecordDict({"config": ConfigRecord({"device": "auto", "clients": 2})}), dst_node_id=1,
                  message_type="train")
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "device": "cpu"}, state=RecordDict(),
                  run_config={"device": "auto"})
    assert run_config_of(msg, ctx).device == "cpu"  # the node's own device over the run's and the message's
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    assert run_config_of(msg, ctx).device == "auto"


# -- on a GPU --------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("task, clients, local_steps", [("digits-mlp", 300, 1), ("digits-mlp", 60, 3),
                                                        ("digits-cnn4", 60, 1)])
def test_batched_engine_on_gpu_equals_cpu(task, clients, local_steps):
    from fedswarm.bench import gpu

    # local_steps 1: the one-backward shortcut; 3: every client's own model (vmap)
    cpu = gpu.engine_case(task, clients, 2, "cpu", local_steps)
    dev = gpu.engine_case(task, clients, 2, GPU, local_steps)
    assert cpu["status"] == dev["status"] == "finished"
    assert dev["peak_gpu_mb"] > 0
    assert torch.allclose(cpu["model"], dev["model"], rtol=gpu.ENGINE_RTOL, atol=gpu.ENGINE_ATOL), \
        float((cpu["model"] - dev["model"]).abs().max())


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.dtype.is_floating_point:
        scale = float(a.abs().max()) if a.numel() else 0.0
        assert torch.allclose(a, b, rtol=FLOAT_RTOL, atol=FLOAT_RTOL * scale), \
            f"{what}: max diff {float((a - b).abs().max())}"
    else:
        assert torch.equal(a, b), f"{what}: integer/bit arrays differ"


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CODECS))
def test_codec_on_gpu_equals_cpu(name):
    d = 300_000  # past the sampled top-k threshold's 4 x 16k coordinates
    layout = benchmark_layout(d)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, d, generator=g)
    codec = make_codec(name)
    p_cpu, p_gpu = codec.encode(x, layout, seed=7), codec.encode(x.to(GPU), layout, seed=7)
    assert set(p_cpu.arrays) == set(p_gpu.arrays) and p_cpu.meta == p_gpu.meta
    for key in p_cpu.arrays:
        a, b = torch.as_tensor(p_cpu.arrays[key]), torch.as_tensor(p_gpu.arrays[key])
        if name == "qsgd" and key == "codes":  # another random stream: each code rounds y up or down
            assert int((a.cpu().to(torch.int64) - b.cpu().to(torch.int64)).abs().max()) <= 1
        else:
            _close(a, b, f"{name}.{key}")
    # decoding the same payload on the GPU gives the CPU's vector
    _close(codec.decode(p_cpu, layout), codec.decode(p_cpu, layout, device=GPU), f"{name} decode")
    out = torch.empty(2, d, device=GPU)
    assert codec.decode(p_gpu, layout, out=out).data_ptr() == out.data_ptr()


@pytest.mark.cuda
def test_memory_budget_holds_on_gpu(tmp_path):
    """Peak allocated <= budget + slack, the slack being what is not the clients' working
    set: the training and test data on the device, the global model and 4 MiB for the
    allocator's rounding and the evaluation's batch."""
    from fedswarm.config import RunConfig
    from fedswarm.sim.run import run_engine
    from fedswarm.store import Store
    from fedswarm.train import task_data

    budget = 8 * 2**20
    cfg = RunConfig(task="digits-mlp", clients=2000, rounds=1, local_steps=2, batch_size=16, engine="batched",
                    device=GPU, memory_budget=str(budget))
    data = task_data(cfg)
    slack = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y)) \
        + 2 * 4 * 4810 + 4 * 2**20
    torch.cuda.synchronize(GPU)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(GPU)
    torch.cuda.reset_peak_memory_stats(GPU)
    store = Store(tmp_path / "s.db")
    rid = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=rid) == "finished"
    store.close()
    peak = torch.cuda.max_memory_allocated(GPU) - base
    # the budget binds: all 2000 clients' [d] states at once would need ~40x more than it
    assert 2000 * 10 * 4 * 4810 > 40 * budget
    assert peak <= budget + slack, (peak, budget, slack)


@pytest.mark.cuda
@pytest.mark.integration
def test_deployment_with_a_cuda_supernode_and_a_cpu_one(tmp_path):
    from tests.deployment_helpers import run_on_devices

    res = run_on_devices(tmp_path, [GPU, "cpu"], rounds=3)
    assert res["status"] == "finished" and res["rounds"] == 3 and res["clients_per_round"] == [2, 2, 2], res
    assert res["train_devices"] == sorted(["cpu", str(torch.device(GPU))]), res
    assert res["test_accuracy"] > 0.5
