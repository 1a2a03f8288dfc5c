"""The ``fedswarm`` command line.

Every command explains itself with ``--help``. Bad config keys or values print one line
naming the key and what is allowed, and exit with code 2.
"""

from __future__ import annotations

from pathlib import Path

import typer

from fedswarm.cli.common import VERBOSE_HELP, console, fail, log_file_for, route_logs, say_log_file
from fedswarm.cli.runs import runs_app, strategies
from fedswarm.cli.serve import client, dashboard, rekey
from fedswarm.cli.simulation import SimCommand, resume, sim

__all__ = ["app", "main"]

app = typer.Typer(
    name="fedswarm",
    help="Federated and decentralized learning on Flower: simulate, deploy, watch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# The commands, in the order `fedswarm --help` lists them.
app.command(no_args_is_help=False, cls=SimCommand)(sim)
app.command()(resume)
app.add_typer(runs_app, name="runs")
app.command()(strategies)
app.command()(client)


# --------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------
def bench(
    name: str = typer.Argument(..., help=(
        "Benchmark name: engines, engines-ray (the batched engine on 1 and 2 Ray workers against one process), "
        "codecs, compression, decentralized, edge, swarm, dashboard, dashboard-runs "
        "(`fedswarm dashboard` under 50 connections to /api/runs alone; FEDSWARM_BENCH_BEFORE=CHECKOUT runs another "
        "checkout's code beside it), ingest, robust, privacy, secagg (fedswarm's SecAgg+ beside Flower's, one round; "
        "FEDSWARM_SECAGG_GRID=n:d,... picks sizes), async (FedBuff and quorum rounds against synchronous FedAvg on a "
        "simulated fleet: time to 0.90 accuracy; FEDSWARM_ASYNC_SEEDS=0-9 runs other seeds, "
        "FEDSWARM_ASYNC_ARMS=fedbuff a subset of the arms beside synchronous FedAvg), minibatch (a batched round's "
        "minibatch draw beside its local SGD; FEDSWARM_BENCH_BEFORE=CHECKOUT runs another checkout's code beside "
        "it), "
        "footprint (install size, import time and a SuperNode's memory, beside Flower alone), papers "
        "(every seed paper's claim in miniature; also writes DIR/reproductions.md; --quick about 2 min, full mode "
        "about 30 min on 2 quiet cores; FEDSWARM_PAPERS_ONLY=id1,id2 runs a subset)."
    )),
    out: Path = typer.Option(Path("bench"), "--out", "-o", help="Writes DIR/NAME.json, NAME.png, flower.log."),
    quick: bool = typer.Option(False, "--quick", help=(
        "A smaller run that finishes in under two minutes on 2 cores.")),
    device: str = typer.Option("cpu", "--device", help=(
        "Torch device for benchmarks that take one (codecs, engines): cpu, cuda or cuda:N; a GPU's rows are printed "
        "beside the CPU's. A device this machine lacks is refused in one line (exit 2)."
    )),
    profile: bool = typer.Option(False, "--profile", help=(
        "dashboard, dashboard-runs: also sample the server under the /api/runs load with py-spy (when installed) and "
        "write where its time goes to DIR/dashboard-runs-profile-SERVER.txt."
    )),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Run a benchmark: prints a table, writes JSON and a PNG, compares side by side in one run."""
    from fedswarm.bench.registry import BENCHMARKS, run_benchmark

    if name not in BENCHMARKS:
        fail(f"unknown benchmark '{name}' (available: {', '.join(BENCHMARKS)})")
    log_file = log_file_for(out)
    route_logs(verbose, log_file)
    run_benchmark(name, out, quick=quick, console=console, device=device, profile=profile)
    say_log_file(log_file, verbose)


app.command()(bench)
app.command()(dashboard)
app.command()(rekey)


def _mount_swarm() -> None:
    """``fedswarm peer``, ``fedswarm swarm`` and ``fedswarm keys`` come from the swarm runtime."""
    from fedswarm.swarm.cli import keys, peer, swarm

    app.command()(peer)
    app.command()(swarm)
    app.command()(keys)


_mount_swarm()


def _mount_certs() -> None:
    """``fedswarm certs``: the CA, TLS certificates and node keys of a secure deployment."""
    from fedswarm.certs import certs_app

    app.add_typer(certs_app(), name="certs")


_mount_certs()


def main() -> None:
    app()
