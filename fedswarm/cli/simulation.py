"""``fedswarm sim`` and ``fedswarm resume``: a simulation from options or a TOML file, checked
by its engine before it is recorded, and a stopped run continued."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import click
import typer
from typer.core import TyperCommand

from fedswarm.cli.common import DB_HELP, VERBOSE_HELP, console, fail, log_file_for, route_logs, say_log_file
from fedswarm.config import RunConfig, load_config
from fedswarm.errors import ConfigError
from fedswarm.extras import check_run_extras
from fedswarm.kv import parse_items
from fedswarm.sim.engines import engine_help

__all__ = ["SimCommand", "sim", "resume", "parse_policies", "on_off"]


def on_off(value: str | None, option: str) -> bool | None:
    """``on``/``off`` (or true/false) of a switch option; None when not given."""
    if value is None:
        return None
    low = value.strip().lower()
    if low in ("on", "true", "yes", "1"):
        return True
    if low in ("off", "false", "no", "0"):
        return False
    fail(f"invalid value for {option}: '{value}' (use on or off)")


def parse_policies(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["edge-lte:local_steps=2", ...]`` -> ``{"edge-lte": {"local_steps": 2}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        cls, sep, kv = item.partition(":")
        if not sep or not cls.strip():
            raise ConfigError(f"invalid --policy '{item}': expected CLASS:KEY=VALUE")
        out.setdefault(cls.strip(), {}).update(parse_items([kv], what=f"--policy '{item}'"))
    return out


# --------------------------------------------------------------------------------------
# sim
# --------------------------------------------------------------------------------------
STRATEGY_HELP = "Strategy name (see `fedswarm strategies`). Default: fedavg."


class SimCommand(TyperCommand):
    """``fedswarm sim``: its ``--strategy`` and ``--engine`` help list the registered strategies,
    read from the registry when the help is shown (loading every strategy module is not for every
    command line)."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from fedswarm.strategies import registry

        for param in self.params:
            if param.name == "strategy":
                param.help = STRATEGY_HELP.replace(")", f": {', '.join(registry.names())})", 1)
            elif param.name == "engine":
                param.help = engine_help()
        super().format_help(ctx, formatter)


def sim(
    strategy: Optional[str] = typer.Option(None, "--strategy", "-s", help=STRATEGY_HELP),
    task: Optional[str] = typer.Option(None, "--task", "-t", help=(
        "Task: digits-mlp (default; progfed: digits-cnn4), digits-cnn, digits-cnn4, synthetic-logreg, mnist, cifar10, "
        "femnist (and their -resnet variants), or module:function."
    )),
    clients: Optional[int] = typer.Option(None, "--clients", "-n", help="Number of clients (default 20)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", "-r", help="Number of rounds (default 10)."),
    fraction: Optional[float] = typer.Option(None, "--fraction", help=(
        "Fraction of clients sampled per round, in (0, 1] (default 1)."
    )),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help=(
        "Data split: iid (default), dirichlet:ALPHA, shards:K, or dominant:P (client k: a fraction P "
        "of its examples from class k mod C, the rest from the other classes)."
    )),
    local_epochs: Optional[int] = typer.Option(None, "--local-epochs", help="Local epochs per round (default 2)."),
    local_steps: Optional[int] = typer.Option(None, "--local-steps", help=(
        "Local SGD steps per round; overrides --local-epochs."
    )),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Local minibatch size (default 16)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Client learning rate (default 0.3)."),
    momentum: Optional[float] = typer.Option(None, "--momentum", help="Client SGD momentum in [0, 1) (default 0)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for init, split and sampling (default 0)."),
    engine: Optional[str] = typer.Option(None, "--engine", "-e", help=engine_help(strategies=False)),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help=(
        "--engine batched: memory one chunk of clients may use, e.g. 2GB (default: a quarter of free RAM up to 8 GB, "
        "or half the free GPU memory)."
    )),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=(
        "--engine flower: attach to a running Ray cluster at this address (e.g. 127.0.0.1:6379) instead of starting "
        "one. --engine batched: split each round's cohort across Ray actors of that cluster (--workers), each "
        "client's state kept on its actor."
    )),
    workers: Optional[int] = typer.Option(None, "--workers", help=(
        "--engine batched --ray-address: the Ray actors a round's cohort is split across (default 2)."
    )),
    device: Optional[str] = typer.Option(None, "--device", help=(
        "Torch device: cpu (default), auto, cuda, cuda:N, mps."
    )),
    name: Optional[str] = typer.Option(None, "--name", help="A label for the run."),
    devices: Optional[str] = typer.Option(None, "--devices", help=(
        "Device classes for the time model, e.g. gpu:4,edge-wifi:12 (profiles: datacenter, gpu, cpu, edge-wifi, "
        "edge-lte, straggler); rounds then report simulated time (inprocess, flower, batched: the slowest sampled "
        "node's round; round_timeout is wall time and cuts no slow node short unless a fleet option says so)."
    )),
    profiles: Optional[str] = typer.Option(None, "--profiles", help=(
        "A TOML file of device/link profiles merged over the built-in ones."
    )),
    topology: Optional[str] = typer.Option(None, "--topology", help=(
        "Gossip topology for decentralized strategies: ring, torus, exp, onepeer-exp, complete, random:D, "
        "edges:PATH. Default: the strategy's own (ring; easgd complete, d2 ring+lazy: `fedswarm strategies`)."
    )),
    policy: Optional[list[str]] = typer.Option(None, "--policy", help=(
        "Per-device-class policy CLASS:KEY=VALUE (repeatable), e.g. edge-lte:local_steps=2. Keys: local_steps, "
        "local_epochs, batch_size, lr, codec, pvt_fraction, progfed_max_stage."
    )),
    byzantine: Optional[int] = typer.Option(None, "--byzantine", help=(
        "K Byzantine clients (chosen with the seed) whose replies --attack rewrites; recorded per round, never told to"
        " the aggregator."
    )),
    attack: Optional[str] = typer.Option(None, "--attack", help=(
        "NAME[:k=v,...]: signflip[:scale=S], gaussian[:std=S,add=true], alie[:z=Z], ipm[:eps=E], signvote, labelflip, "
        "random (default signflip)."
    )),
    dp: Optional[str] = typer.Option(None, "--dp", help=(
        "Client-level DP-FedAvg: noise_multiplier=N, then optionally ,clip=C ,delta=D ,adaptive=true "
        ",target_epsilon=E; or "
        "target_epsilon=E[,delta=D] (noise calibrated to the rounds). Epsilon is reported every round. With "
        "--secagg: distributed DP, each node clips and adds its share of integer noise before masking "
        "(mechanism=dgauss|skellam, default dgauss; noise_multiplier=N needed; secure=true draws it from the OS)."
    )),
    dp_sgd: Optional[str] = typer.Option(None, "--dp-sgd", help=(
        "Example-level DP-SGD in every client (opacus): noise_multiplier=N, then optionally ,clip=C ,delta=D "
        ",target_epsilon=E."
    )),
    secagg: bool = typer.Option(False, "--secagg", help=(
        "Secure aggregation (SecAgg+): the server learns only the sum of the nodes' quantized updates "
        "(docs/secagg.md); strategies whose entry says secagg (fedavg, ...)."
    )),
    secagg_threshold: Optional[float] = typer.Option(None, "--secagg-threshold", help=(
        "--secagg: shares needed to rebuild a node's secrets, a fraction of its neighbourhood in (0.5, 1] "
        "(default 0.6) or a count."
    )),
    secagg_clip: Optional[float] = typer.Option(None, "--secagg-clip", help=(
        "--secagg: clip each coordinate of a node's model change to [-C, C] (default 1.0)."
    )),
    secagg_bits: Optional[int] = typer.Option(None, "--secagg-bits", help=(
        "--secagg: field bits b, 8..64 (default 32); quantization levels are the most that cannot wrap."
    )),
    secagg_dropout: Optional[float] = typer.Option(None, "--secagg-dropout", help=(
        "--secagg: simulated dropout, the probability a node vanishes at one stage drawn from the seed; its "
        "replies from there on are lost (default 0)."
    )),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", help=(
        "Checkpoint the server into the store every K rounds (default 1); `fedswarm resume` redoes at most K - 1 "
        "rounds. Larger K: less checkpoint time and store traffic."
    )),
    client_data: Optional[Path] = typer.Option(None, "--client-data", help=(
        "A folder with one dataset per client, sorted by name (files or folders in the formats of `fedswarm client "
        "--data`): each client trains on its own data; --clients defaults to their count."
    )),
    label_column: Optional[str] = typer.Option(None, "--label-column", help=(
        "--client-data: the label column of tables (default label)."
    )),
    val_fraction: Optional[float] = typer.Option(None, "--val-fraction", help=(
        "--client-data: share of each client's examples held out for its validation (default 0.2)."
    )),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help=(
        "Federated evaluation every K rounds (default 1): the round's nodes score the model (a decentralized "
        "node: its own) on their own validation split (fed_accuracy); on the virtual clock a round is --clients "
        "local steps."
    )),
    central_eval: Optional[str] = typer.Option(None, "--central-eval", help=(
        "on (default) | off: off runs with no server test set; only the nodes' federated evaluation is reported "
        "(every engine)."
    )),
    quorum: Optional[int] = typer.Option(None, "--quorum", help=(
        "Federated strategies: close each round once K replies are in (K at most the nodes a round samples) instead "
        "of waiting for every sampled node (up to round_timeout, 600 s); later replies are discarded and recorded as "
        "'late'. The first K in simulated time with --devices, else in wall time (in-process: can vary between runs). "
        "Default with --over-select: "
        "the nodes the strategy needs. --engine inprocess or flower; batched with every strategy it serves but "
        "fedbuff."
    )),
    over_select: Optional[float] = typer.Option(None, "--over-select", help=(
        "Federated strategies: sample F >= 1 times the nodes the strategy needs each round (e.g. 1.3, with "
        "--fraction below 1/F: refused at fraction 1); the round closes on the first replies of the nodes needed "
        "(--quorum to say how many). --engine inprocess or flower; batched with every strategy it serves but "
        "fedbuff."
    )),
    eligible: Optional[str] = typer.Option(None, "--eligible", help=(
        "Sample only nodes whose last telemetry passes these rules, e.g. 'battery>=40,charging,temp<45' (battery, "
        "temp, rss with <, <=, >, >=, ==; charging, !charging); per device class: an 'eligible' key in the class's "
        "policy of a --config file. A node is probed for its telemetry before a round it did not train in the "
        "round before; a skipped node's row says why ('ineligible'). --engine inprocess or flower; batched with "
        "every strategy it serves; fedbuff dispatches only eligible nodes (every engine "
        "but array and clock, and in a deployment)."
    )),
    availability: Optional[str] = typer.Option(None, "--availability", help=(
        "Simulated availability (needs --devices): on=S,off=S (mean seconds on and off), then optionally ,diurnal=A "
        "(in [0, 1)) ,period=S ,dropout=P (in [0, 1)), for every class; CLASS:on=S,off=S;CLASS:... per class; or a "
        "trace CSV file with the header node,start_s,end_s (docs/devices.md section 7). Offline nodes are "
        "not sampled; a node that drops mid-round loses its update. --engine inprocess or flower; batched with "
        "every strategy it serves (fedbuff: inprocess and batched); clock with adpsgd, "
        "prague and lsgd --set mode=async (an offline node neither trains nor exchanges)."
    )),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Strategy hyperparameter KEY=VALUE (repeatable)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=(
        "A TOML run config; command-line options override it."
    )),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write result.json, accuracy.png, flower.log here."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    run_id: Optional[str] = typer.Option(None, "--run-id", help=(
        "Record into this existing run of the store (used by the dashboard)."
    )),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Simulate a federation on this machine: progress bar, summary table, result.json.

    Example: fedswarm sim --strategy fedavg --clients 20 --rounds 10 --partition iid --out out
    """
    from fedswarm.strategies import registry

    cli_values = {
        "strategy": strategy, "task": task, "clients": clients, "rounds": rounds, "fraction": fraction,
        "partition": partition, "local_epochs": local_epochs, "local_steps": local_steps,
        "batch_size": batch_size, "lr": lr, "momentum": momentum, "seed": seed, "engine": engine,
        "device": device, "name": name, "devices": devices, "profiles": profiles, "topology": topology,
        "byzantine": byzantine, "attack": attack, "dp": dp, "dp_sgd": dp_sgd,
        "memory_budget": memory_budget, "ray_address": ray_address, "checkpoint_every": checkpoint_every,
        "workers": workers,
        "client_data": str(client_data) if client_data else None, "label_column": label_column,
        "val_fraction": val_fraction,
        "eval_every": eval_every, "central_eval": on_off(central_eval, "--central-eval"),
        "quorum": quorum, "over_select": over_select, "eligible": eligible, "availability": availability,
        "secagg": secagg or None, "secagg_threshold": secagg_threshold, "secagg_clip": secagg_clip,
        "secagg_bits": secagg_bits, "secagg_dropout": secagg_dropout,
    }
    log_file = log_file_for(out)
    try:
        if quorum is not None and quorum < 1:  # the run config reads 0 as "no quorum" (Flower's has no null)
            raise ConfigError(f"--quorum must be at least 1 reply, got {quorum}")
        values: dict[str, Any] = load_config(config) if config else {}
        values.update({k: v for k, v in cli_values.items() if v is not None})
        params = dict(values.get("params", {}) or {})
        params.update(parse_items(set_, what="--set"))
        values["params"] = params
        policies = {k: dict(v) for k, v in (values.get("policies") or {}).items()}
        for cls, kv in parse_policies(policy).items():
            policies.setdefault(cls, {}).update(kv)
        values["policies"] = policies
        _client_data_clients(values)
        cfg = RunConfig.build(registry.with_run_defaults(values))
        route_logs(verbose, log_file, ray=cfg.engine == "flower")  # before the strategy is built to check it
        cfg.params = registry.resolve_params(cfg.strategy, cfg.params)
        from fedswarm.tasks import get_task

        from fedswarm.train import check_node_device

        check_node_device(cfg.device)  # a device this machine lacks: one line, before the run is recorded
        get_task(cfg.task)
        if cfg.client_data:  # every client's data read and checked now: bad data stops the run before it starts
            from fedswarm.train import local_validation

            for k in range(cfg.clients):
                local_validation(cfg, k)
        from fedswarm.sim.engines import check_run

        # the engine's own check: a bad combination is one line (exit 2), not a failed run; the run
        # takes the strategy it built
        checked = check_run(cfg)
        check_run_extras(cfg)
    except ValueError as exc:  # ConfigError, or a client's LocalDataError
        fail(str(exc))
    _run(cfg, verbose, log_file, db=db, run_id=run_id, out=out, checked=checked)


def _run(cfg: RunConfig, verbose: bool, log_file: Path, **kwargs: Any) -> None:
    """Run ``cfg`` with its progress bar and summary, then say where Flower's log went; exit 1
    if the run failed."""
    from fedswarm.sim.run import run_simulation_cli

    status = run_simulation_cli(cfg, console=console, **kwargs)
    say_log_file(log_file, verbose)
    if status == "failed":
        raise typer.Exit(1)


def resume(
    run_id: str = typer.Argument(..., help="The run to continue (see `fedswarm runs`)."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write result.json, accuracy.png, flower.log here."),
    federation: Optional[str] = typer.Option(
        None, "--federation", help="A deployment run: the SuperLink connection (in $FLWR_HOME/config.toml) to "
                                   "resume it on, with `flwr run`."),
    app_dir: Optional[Path] = typer.Option(None, "--app", help="A deployment run: the Flower App to run (default: "
                                                                "this fedswarm's project directory)."),
    accept_client_state_loss: bool = typer.Option(
        False, "--accept-client-state-loss", help="Resume even though the clients' own state (error-feedback "
        "residuals, replicas, decentralized nodes' models) cannot be restored: --engine flower runs on a Ray cluster "
        "(--ray-address) of such strategies. The clients are resynchronised; the model will differ from an "
        "uninterrupted run's."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Continue a failed, stopped or killed run from its last checkpoint, in the same run and store.

    Every round of every run is checkpointed in the store. The run goes on from the round after
    its checkpoint up to its total, on the engine it ran on; rounds recorded after the checkpoint
    are redone, so each round is recorded once. A deployment run (`flwr run`) resumes on the
    SuperLink given with --federation. The resume is exact (same model as uninterrupted): the
    in-process engine checkpoints the clients' state with the server's; in a deployment
    (`fedswarm client --state-dir`) and on Flower's engine the nodes keep their own state on disk
    after every round and restore it when the resumed run asks, and a node that has lost it is
    resynchronised by the protocol (named in a client_resync event). Flower's engine on a Ray
    cluster (--ray-address) keeps no node state: such a run of a strategy with client state is
    refused unless --accept-client-state-loss."""
    from fedswarm.errors import CheckpointError
    from fedswarm.server.resume import prepare_resume
    from fedswarm.store import Store

    store = Store(db)
    try:
        cfg, checkpoint = prepare_resume(store, run_id, accept_client_state_loss=accept_client_state_loss)
    except CheckpointError as exc:
        fail(str(exc))
    run = store.get_run(run_id)
    if run.engine == "deployment":
        if not federation:
            fail(f"run '{run_id}' ran on a SuperLink: give --federation NAME (a connection in "
                 f"$FLWR_HOME/config.toml) to resume it there")
        _resume_deployment(run_id, store.url, federation, app_dir, accept_client_state_loss)
        return
    if federation:
        fail(f"run '{run_id}' is a simulation (engine {run.engine or cfg.engine}); --federation is for deployment runs")
    log_file = log_file_for(out)
    route_logs(verbose, log_file, ray=cfg.engine == "flower")
    console.print(f"resuming run [bold]{run_id}[/] after round {checkpoint.round}")
    _run(cfg, verbose, log_file, db=store.url, run_id=run_id, out=out, resume=checkpoint)


def _resume_deployment(run_id: str, db_url: str, federation: str, app_dir: Path | None,
                       accept_loss: bool = False) -> None:
    """``flwr run APP FEDERATION`` with the run config that makes fedswarm's ServerApp resume."""
    import shutil
    import subprocess

    from fedswarm.server.resume import ACCEPT_LOSS_KEY, RESUME_KEY

    app_dir = app_dir or Path(__file__).resolve().parents[2]
    if not (app_dir / "pyproject.toml").is_file():
        fail(f"no Flower App in {app_dir} (no pyproject.toml): give --app DIR")
    flwr = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    run_config = f"run-id={json.dumps(run_id)} db={json.dumps(db_url)} {RESUME_KEY}=true"
    if accept_loss:
        run_config += f" {ACCEPT_LOSS_KEY}=true"
    proc = subprocess.run([flwr, "run", str(app_dir), federation, "--run-config", run_config],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"flwr run failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}", code=1)
    console.print(f"run [bold]{run_id}[/] resumes on federation '{federation}'; follow it with "
                  f"`fedswarm runs --db {db_url}`")


def _client_data_clients(values: dict[str, Any]) -> None:
    """--client-data: the folder's path made absolute, --clients its number of datasets."""
    if not values.get("client_data"):
        return
    from fedswarm.tasks.localdata import LocalDataError, client_datasets

    try:
        paths = client_datasets(values["client_data"])
    except LocalDataError as exc:
        raise ConfigError(str(exc)) from None
    if values.get("partition") not in (None, "iid"):
        raise ConfigError(f"invalid value for 'partition': '{values['partition']}' splits the task's own data; with "
                          "--client-data every client trains on its own dataset (leave --partition out)")
    values["client_data"] = str(Path(values["client_data"]).expanduser().resolve())
    if values.get("clients") is None:
        values["clients"] = len(paths)
    elif int(values["clients"]) != len(paths):
        raise ConfigError(f"invalid value for 'clients': {values['clients']} clients but --client-data "
                          f"{values['client_data']} holds {len(paths)} datasets (one per client)")
