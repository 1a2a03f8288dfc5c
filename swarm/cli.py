"""``fedswarm peer``, ``fedswarm swarm`` and ``fedswarm keys``.

The three functions are plain typer commands, to be mounted on the main app
(``app.command()(peer)``) or used through this module's own app::

    python -m fedswarm.swarm.cli keys --dir keys/
    python -m fedswarm.swarm.cli peer --listen 127.0.0.1:7070 --allow allow.txt --keys keys/
    python -m fedswarm.swarm.cli swarm --peers 4 --algorithm dpsgd --rounds 10 --out out/swarm
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import typer

__all__ = ["app", "keys", "peer", "swarm"]

app = typer.Typer(name="swarm", help="Peer-to-peer training with no server.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _params(items: list[str] | None) -> dict:
    from fedswarm.kv import parse_items

    try:
        return parse_items(items, what="--set")
    except ValueError as exc:
        _fail(str(exc))


def peer(
    listen: str = typer.Option("127.0.0.1:7070", "--listen", help=(
        "HOST:PORT to listen on; PORT 0 takes a free port, written to STATE_DIR/address once bound."
    )),
    join: list[str] | None = typer.Option(None, "--join", help="HOST:PORT of any known peer (repeatable)."),
    algorithm: str = typer.Option("dpsgd", "--algorithm", "-a", help=(
        "dpsgd, d2, dsgdm, qgm, adpsgd, lsgd, swarm_merge, squarm."
    )),
    set_: list[str] | None = typer.Option(None, "--set", help="Algorithm hyperparameter KEY=VALUE (repeatable)."),
    task: str = typer.Option("digits-mlp", "--task", "-t", help="Task (model + data)."),
    partition: str = typer.Option("iid", "--partition", "-p", help="iid, dirichlet:ALPHA, shards:K or dominant:P."),
    partition_id: int = typer.Option(0, "--partition-id", min=0, help="This peer's data partition."),
    num_partitions: int = typer.Option(1, "--num-partitions", min=1, help=(
        "How many partitions the data is split into."
    )),
    data: Path | None = typer.Option(None, "--data", help=(
        "Train on this peer's own dataset instead of a partition (formats of `fedswarm client --data`, see "
        "docs/devices.md); checked before the peer starts."
    )),
    label_column: str = typer.Option("label", "--label-column", help="--data: the label column of a table."),
    val_fraction: float = typer.Option(0.2, "--val-fraction", help=(
        "--data: share of the examples held out as the peer's validation split, in [0, 1)."
    )),
    rounds: int = typer.Option(10, "--rounds", "-r", min=1, help="Rounds to train."),
    local_steps: int = typer.Option(10, "--local-steps", min=1, help="Local SGD steps per round."),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Local minibatch size."),
    lr: float = typer.Option(0.1, "--lr", min=0.0, help="Learning rate."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed (model init is shared by every peer)."),
    topology: str = typer.Option("ring", "--topology", help=(
        "Topology over the sorted member ids: ring, torus, exp, complete, ..."
    )),
    keys_dir: Path | None = typer.Option(None, "--keys", help=(
        "Key directory (created on first start). Default: STATE_DIR/keys."
    )),
    allow: Path | None = typer.Option(None, "--allow", help="Allow list: one public key per line, # comments."),
    insecure_allow_any: bool = typer.Option(False, "--insecure-allow-any", help="Admit any key (loopback demos only)."),
    state_dir: Path = typer.Option(Path("peer-state"), "--state-dir", help="Checkpoint, result.json and models."),
    min_peers: int = typer.Option(1, "--min-peers", min=1, help="Wait until this many peers are known before round 1."),
    round_timeout: float = typer.Option(10.0, "--round-timeout", min=0.1, help=(
        "Seconds to wait for neighbours in a round."
    )),
    heartbeat: float = typer.Option(0.5, "--heartbeat", min=0.01, help="Heartbeat interval in seconds."),
    suspect_after: int = typer.Option(4, "--suspect-after", min=1, help=(
        "Missed heartbeats before a peer is suspected."
    )),
    remove_after: int = typer.Option(8, "--remove-after", min=1, help="Missed heartbeats before a peer is removed."),
    db: str | None = typer.Option(None, "--db", help="Record into this run store (SQLite path or URL)."),
    report: str | None = typer.Option(None, "--report", help="Dashboard URL to POST heartbeats and rounds to."),
    token: str | None = typer.Option(None, "--token", envvar="FEDSWARM_TOKEN", help="Reporter API token for --report."),
    run_id: str | None = typer.Option(None, "--run-id", help="Run id to report under (default swarm-ALGORITHM-SEED)."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="TLS certificate (PEM) of this peer."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="TLS private key (PEM) of this peer."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help=(
        "CA to verify peers' certificates (default: encrypt only)."
    )),
    swarm_ca: Path | None = typer.Option(None, "--swarm-ca", help=(
        "Permissioned swarm: only peers with a certificate this CA issued (`fedswarm certs`) may join; mutual TLS, "
        "identity bound to the certificate. --tls-key defaults to the identity key."
    )),
    tls_crl: Path | None = typer.Option(None, "--tls-crl", help=(
        "The swarm CA's revocation list (crl.pem from `fedswarm certs revoke`)."
    )),
    encrypt: bool = typer.Option(True, "--encrypt/--no-encrypt", help=(
        "Without TLS, start every connection with a Noise XX handshake (ephemeral X25519 keys authenticated by the "
        "peers' identity keys) and send everything AES-256-GCM encrypted under its session keys: forward secrecy, "
        "a recorded link stays secret even if identity keys are stolen later. --no-encrypt: bodies in clear "
        "(signed and tagged). FEDSWARM_NOISE_PIPELINE=on encrypts a model's records on a second thread while "
        "earlier ones are written (off by default: slower on 2 cores; see `fedswarm bench swarm`)."
    )),
    legacy_static_keys: bool = typer.Option(False, "--legacy-static-keys", help=(
        "Only to talk to peers of older fedswarm versions: no handshake, bodies encrypted under keys derived from "
        "the two peers' static identity keys. NO forward secrecy: whoever steals a key later decrypts every "
        "recorded model."
    )),
    max_body_mb: int = typer.Option(1024, "--max-body-mb", min=1, help="Largest message body accepted, MiB."),
    save_models: bool = typer.Option(False, "--save-models", help=(
        "Save the model of every round under STATE_DIR/models."
    )),
    linger: float = typer.Option(5.0, "--linger", min=0.0, help="Seconds to keep serving after the last round."),
    min_round_s: float = typer.Option(0.0, "--min-round-s", min=0.0, help="Pace: each round lasts at least this long."),
    device: str = typer.Option("cpu", "--device", help="Torch device."),
    threads: int = typer.Option(1, "--threads", min=0, help="Torch CPU threads (0: torch's default)."),
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING."),
) -> None:
    """Join a swarm: train on a local partition and gossip with peers (no server)."""
    from fedswarm.swarm.peer import Peer, PeerConfig

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    if report and not token:
        _fail("--report needs --token (or $FEDSWARM_TOKEN)")
    from pydantic import ValidationError

    from fedswarm.config import describe_validation_error

    try:
        cfg = PeerConfig(
            listen=listen, join=list(join or []), algorithm=algorithm, params=_params(set_), task=task,
            partition=partition, partition_id=partition_id, num_partitions=num_partitions, rounds=rounds,
            local_steps=local_steps, batch_size=batch_size, lr=lr, seed=seed, topology=topology,
            keys=str(keys_dir) if keys_dir else None, allow=str(allow) if allow else None,
            insecure_allow_any=insecure_allow_any, state_dir=str(state_dir), min_peers=min_peers,
            round_timeout_s=round_timeout, heartbeat_s=heartbeat, suspect_after=suspect_after,
            remove_after=remove_after, db=db, report_url=report, token=token, run_id=run_id,
            tls_cert=str(tls_cert) if tls_cert else None, tls_key=str(tls_key) if tls_key else None,
            tls_ca=str(tls_ca) if tls_ca else None, swarm_ca=str(swarm_ca) if swarm_ca else None,
            tls_crl=str(tls_crl) if tls_crl else None, encrypt=encrypt, legacy_static_keys=legacy_static_keys,
            max_body_mb=max_body_mb,
            save_models=save_models, data_path=str(data.expanduser().resolve()) if data else None,
            label_column=label_column, val_fraction=val_fraction,
            linger_s=linger, min_round_s=min_round_s, device=device, threads=threads)
    except ValidationError as exc:
        _fail(describe_validation_error(exc))
    if cfg.data_path:  # bad data stops the peer here, before it binds or joins
        from fedswarm.tasks.localdata import load_local

        try:
            load_local(cfg.task, cfg.local_data(), cfg.seed)
        except ValueError as exc:
            _fail(str(exc))
    try:
        p = Peer(cfg)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    p.install_signal_handlers()
    typer.echo(f"peer {p.id} listening on {p.transport.address}", err=True)
    try:
        summary = p.run()
    except RuntimeError as exc:
        _fail(str(exc), code=1)
    typer.echo(json.dumps({k: summary[k] for k in ("peer_id", "rounds_done", "bytes_up", "bytes_down", "dropped")}))
    # Everything is on disk (result.json, the fsynced checkpoint): skip the interpreter's
    # teardown of torch, which takes seconds and delays a swarm's shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def swarm(
    peers: int = typer.Option(4, "--peers", "-n", min=1, max=256, help="Number of peer processes."),
    algorithm: str = typer.Option("dpsgd", "--algorithm", "-a", help=(
        "dpsgd, d2, dsgdm, qgm, adpsgd, lsgd, swarm_merge, squarm."
    )),
    rounds: int = typer.Option(10, "--rounds", "-r", min=1, help="Rounds."),
    out: Path = typer.Option(Path("swarm-out"), "--out", "-o", help=(
        "Writes DIR/result.json; peers' state under DIR/peers."
    )),
    fail: str | None = typer.Option(None, "--fail", help="K@R: kill K peers when the swarm reaches round R."),
    restart_after: float | None = typer.Option(None, "--restart-after", help=(
        "Restart the killed peers after this many seconds."
    )),
    task: str = typer.Option("digits-mlp", "--task", "-t", help="Task (model + data)."),
    partition: str = typer.Option("iid", "--partition", "-p", help="iid, dirichlet:ALPHA, shards:K or dominant:P."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed."),
    base_port: int = typer.Option(0, "--base-port", min=0, max=65000, help="Peer i listens on BASE+i (0: free ports)."),
    local_steps: int = typer.Option(10, "--local-steps", min=1, help="Local SGD steps per round."),
    lr: float = typer.Option(0.1, "--lr", min=0.0, help="Learning rate."),
    topology: str = typer.Option("ring", "--topology", help="Topology over the sorted member ids."),
    set_: list[str] | None = typer.Option(None, "--set", help="Algorithm hyperparameter KEY=VALUE (repeatable)."),
    round_timeout: float = typer.Option(10.0, "--round-timeout", min=0.1, help=(
        "Seconds to wait for neighbours in a round."
    )),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Stop everything after this many seconds."),
) -> None:
    """Start N peers on this machine, wait for them and write DIR/result.json."""
    from fedswarm.swarm.drivers import algorithm_names
    from fedswarm.swarm.launcher import SwarmSpec, launch_swarm, parse_fail

    if algorithm not in algorithm_names():
        _fail(f"unknown algorithm '{algorithm}' (available: {', '.join(algorithm_names())})")
    try:
        spec = SwarmSpec(peers=peers, algorithm=algorithm, rounds=rounds, out=out, fail=parse_fail(fail),
                         restart_after_s=restart_after, task=task, partition=partition, seed=seed,
                         base_port=base_port, local_steps=local_steps, lr=lr, topology=topology,
                         params=_params(set_), round_timeout_s=round_timeout, timeout_s=timeout)
    except ValueError as exc:
        _fail(str(exc))
    if spec.fail and spec.fail[0] >= peers:
        _fail(f"--fail would kill {spec.fail[0]} of {peers} peers; keep at least one")
    try:
        result = launch_swarm(spec, log=lambda m: typer.echo(m, err=True))
    except RuntimeError as exc:  # a peer died before it listened: its log's tail says why
        _fail(str(exc), code=1)
    _print_table(result)
    typer.echo(f"wrote {out / 'result.json'}")


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"swarm {result['config']['strategy']}: {result['summary']['peers']} peers")
    for col in ("round", "peers", "node-avg acc", "mean peer acc", "consensus", "bytes up", "round s"):
        t.add_column(col, justify="right")
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731  (— = not measured)
    for r in result["rounds"]:
        t.add_row(str(r["round"]), str(r["num_clients"]), f(r["test_accuracy"], ".3f"), f(r["mean_peer_accuracy"],
                                                                                          ".3f"),
                  f(r.get("consensus_distance"), ".3g"), f(r["bytes_up"], ","), f(r["wall_s"], ".2f"))
    Console(width=None if sys.stdout.isatty() else 140).print(t)


def keys(
    dir: Path = typer.Option(Path("keys"), "--dir", help="Key directory; the key pair is created on first use."),
) -> None:
    """Create (first time) and print this peer's public key, for the other peers' allow lists."""
    from fedswarm.swarm.net.identity import create_or_load

    try:
        ident = create_or_load(dir)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"{ident.peer_id}  # base64 {ident.public_b64}, private key {dir / 'private.pem'} (mode 600)")


app.command()(peer)
app.command()(swarm)
app.command()(keys)

if __name__ == "__main__":
    app()
