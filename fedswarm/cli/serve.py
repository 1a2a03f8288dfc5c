"""``fedswarm client`` and ``fedswarm dashboard``: the two long-running services a deployment
starts (a Flower SuperNode running fedswarm's ClientApp, and the web dashboard), and
``fedswarm rekey``, which re-seals the dashboard's webhook secrets under a new key. Mounted on
the ``fedswarm`` app by :mod:`fedswarm.cli`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from fedswarm.cli.common import DB_HELP, fail

__all__ = ["client", "dashboard", "rekey"]


def client(
    superlink: str = typer.Option(..., "--superlink", help="The SuperLink's Fleet API address, HOST:PORT."),
    partition_id: int = typer.Option(0, "--partition-id", min=0, help=(
        "Which data partition this node trains on; with --data only the node's id (its round seed and place in a "
        "gossip topology)."
    )),
    num_partitions: int = typer.Option(1, "--num-partitions", min=1, help=(
        "How many partitions the data is split into."
    )),
    device_class: Optional[str] = typer.Option(None, "--device-class", help=(
        "Device class reported to the server (default: probed)."
    )),
    device: Optional[str] = typer.Option(None, "--device", help=(
        "Torch device this node trains on: auto, cpu, cuda or cuda:N (default: the run config's device). "
        "Checked at start: a device this machine lacks is refused."
    )),
    insecure: bool = typer.Option(False, "--insecure", help="Connect without TLS (loopback tests and demos only)."),
    root_certificates: Optional[Path] = typer.Option(None, "--root-certificates", help=(
        "CA certificate for TLS (ca.pem from `fedswarm certs`)."
    )),
    auth_key: Optional[Path] = typer.Option(None, "--auth-key", help=(
        "This node's authentication private key (supernodes/NAME.key from `fedswarm certs`); its .pub must be "
        "registered on the SuperLink with `flwr supernode register`."
    )),
    clientappio_port: Optional[int] = typer.Option(None, "--clientappio-port", help=(
        "Local port for the SuperNode's ClientAppIo API (default: Flower's)."
    )),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help=(
        "Where the node keeps its own state (error-feedback residuals, replicas, a decentralized node's model) "
        "after every round, per run, so `fedswarm resume` continues the run exactly (default: "
        "$XDG_DATA_HOME/fedswarm/client-state, else ~/.local/share/fedswarm/client-state)."
    )),
    state_keep_runs: int = typer.Option(5, "--state-keep-runs", min=0, help=(
        "How many runs' state the node keeps in --state-dir: when a run first saves, the folders of all but the "
        "N most recently written runs are removed (0 keeps every run; a removed run still resumes, with its nodes "
        "resynchronised instead of exact)."
    )),
    data: Optional[Path] = typer.Option(None, "--data", help=(
        "Train on this node's own dataset instead of a partition: an .npz (x, y), a .csv or .parquet file with a "
        "label column, an ImageFolder, or a folder saved by Hugging Face datasets (see docs/devices.md). Checked "
        "before the node starts."
    )),
    label_column: str = typer.Option("label", "--label-column", help="--data: the label column of a table."),
    val_fraction: float = typer.Option(0.2, "--val-fraction", help=(
        "--data: share of the examples held out as the node's validation split, in [0, 1) (seeded by the run "
        "seed)."
    )),
    task: str = typer.Option("digits-mlp", "--task", "-t", help=(
        "--data: the task the data is checked against before the node starts (the run's task must be the same)."
    )),
    rejoin_wait: float = typer.Option(75.0, "--rejoin-wait", min=0, help=(
        "With --auth-key: a node restarted after it died without signing off is refused by the SuperLink until "
        "its previous session times out (2 heartbeats, ~60 s); keep starting it again for up to this many "
        "seconds instead of exiting (0: exit at once)."
    )),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the flower-supernode command and exit."),
) -> None:
    """Join a federation: start a Flower SuperNode that runs fedswarm's ClientApp."""
    from fedswarm.client.supernode import supernode_command

    local = _check_data(data, label_column, val_fraction, task) if data is not None else None
    if partition_id >= num_partitions:
        fail(f"invalid value for 'partition-id': must be < num-partitions ({num_partitions}) (got {partition_id})")
    if not insecure and root_certificates is None:
        fail("TLS needs --root-certificates CA.pem (or pass --insecure for a loopback demo)")
    if device is not None:
        from fedswarm.train import check_node_device

        try:
            check_node_device(device)
        except ValueError as exc:
            fail(str(exc))
    try:
        cmd = supernode_command(superlink, partition_id, num_partitions, device_class=device_class, device=device,
                                insecure=insecure, root_certificates=root_certificates,
                                clientappio_port=clientappio_port, auth_private_key=auth_key,
                                state_dir=state_dir, keep_runs=state_keep_runs, local=local)
    except ValueError as exc:
        fail(str(exc))
    if dry_run:
        print(" ".join(cmd))
        return
    # The SuperNode's SuperExec looks for a new ClientApp task every second by default: a quarter
    # of a second takes most of that wait off every round (set the variable to choose).
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.25")
    if auth_key is None or rejoin_wait <= 0:  # a node id of its own each start: nothing to wait for
        os.execvp(cmd[0], cmd)
    from fedswarm.client.rejoin import exec_supervisor

    exec_supervisor(cmd, rejoin_wait)  # a lean process that watches the SuperNode: not this one, with torch loaded


def _check_data(data: Path, label_column: str, val_fraction: float, task: str):
    """Read and check ``--data`` now, so bad data stops the node at start (exit 2, one line)."""
    from fedswarm.errors import ConfigError
    from fedswarm.tasks.localdata import LocalDataError, LocalDataSpec, load_local

    local = LocalDataSpec(str(data.expanduser().resolve()), label_column, val_fraction)
    try:
        split = load_local(task, local, 0)  # the split's sizes do not depend on the seed
    except (LocalDataError, ConfigError) as exc:
        fail(str(exc))
    skipped = f", {split.skipped} unreadable skipped" if split.skipped else ""
    typer.echo(f"data: {local.path}: {len(split.train_y)} training and {len(split.val_y)} validation examples"
               f"{skipped}", err=True)
    return local


def dashboard(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    superlink: Optional[str] = typer.Option(None, "--superlink", help=(
        "A SuperLink connection name from Flower's config.toml, for the nodes and federation pages (or "
        "$FEDSWARM_SUPERLINK)."
    )),
    https: bool = typer.Option(False, "--https", help=(
        "Users reach the dashboard over HTTPS (e.g. a TLS-terminating proxy): cookies are Secure and pages send HSTS."
    )),
    behind_proxy: bool = typer.Option(False, "--behind-proxy", help=(
        "Trust X-Forwarded-For/-Proto from the proxy in front (client addresses for the login throttle, the scheme). "
        "Only with a proxy really there."
    )),
    trusted_proxies: str = typer.Option("127.0.0.1,::1", "--trusted-proxies", help=(
        "With --behind-proxy: the proxy addresses or networks (comma-separated, e.g. 10.0.0.5,10.1.0.0/16) whose "
        "X-Forwarded-* headers are believed; from any other address they are ignored. '*' trusts every address."
    )),
    certfile: Optional[Path] = typer.Option(None, "--certfile", help=(
        "Serve TLS directly with this certificate (PEM); implies --https."
    )),
    keyfile: Optional[Path] = typer.Option(None, "--keyfile", help="The private key (PEM) of --certfile."),
    report_timeout: Optional[float] = typer.Option(None, "--report-timeout", min=5, help=(
        "Seconds without a report after which a run registered through ingest shows as lost (default 120)."
    )),
    access_log: bool = typer.Option(False, "--access-log", help=(
        "Print a line per request (uvicorn's access log) on stdout. Off by default: under load it costs about a fifth "
        "of the server's time. Errors are logged either way."
    )),
) -> None:
    """Open the web dashboard: start, watch, pause and stop runs; see every node.

    The admin account is created at first start: its password is $FEDSWARM_ADMIN_PASSWORD,
    or a generated one printed once. The API reference is at /docs (served offline).

    Webhook secrets are kept in the store sealed (AES-GCM) under a key outside it:
    $FEDSWARM_SECRET_KEY (which also signs cookies; give every dashboard of one store the same),
    else the key file $FEDSWARM_SECRET_KEY_FILE, by default $XDG_CONFIG_HOME/fedswarm/secret.key
    (~/.config/fedswarm/secret.key), made with mode 0600 at first start. A store copied without
    that key yields no secret; `fedswarm rekey` moves the secrets to a new key."""
    if (certfile is None) != (keyfile is None):
        fail("--certfile and --keyfile go together")
    from fedswarm.extras import MissingExtra, require

    try:
        require("dashboard", "fedswarm dashboard")
        from fedswarm.web.app import proxy_options
        from fedswarm.web.app import run as run_dashboard
    except MissingExtra as exc:
        fail(str(exc), code=1)
    except ImportError as exc:
        fail(f"the dashboard is not available: {exc}", code=1)
    try:
        proxy_options(behind_proxy, trusted_proxies)
    except ValueError as exc:
        fail(f"--trusted-proxies: {exc}")
    from fedswarm.web.secret_box import SecretKeyError

    try:
        run_dashboard(host=host, port=port, db=db, superlink=superlink, https=https, behind_proxy=behind_proxy,
                      trusted_proxies=trusted_proxies,
                      certfile=str(certfile) if certfile else None, keyfile=str(keyfile) if keyfile else None,
                      report_timeout_s=report_timeout, access_log=access_log)
    except SecretKeyError as exc:
        fail(str(exc))


def rekey(
    new_key_file: Optional[Path] = typer.Option(None, "--new-key-file", help=(
        "The new key: this file's content (made with a fresh key and mode 0600 if it does not exist); "
        "$FEDSWARM_NEW_SECRET_KEY instead when set.")),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Re-seal every webhook secret in the store under a new key, in one transaction.

    The current key is the dashboard's: $FEDSWARM_SECRET_KEY, else the key file
    ($FEDSWARM_SECRET_KEY_FILE, by default $XDG_CONFIG_HOME/fedswarm/secret.key). Stop the
    dashboards first; then start them with the new key (FEDSWARM_SECRET_KEY_FILE=NEW_KEY_FILE, or
    the file moved to the default place, or $FEDSWARM_SECRET_KEY set to the new key). The secrets
    themselves do not change: receivers need nothing new."""
    from fedswarm.store import Store
    from fedswarm.web.secret_box import SecretBox, SecretKeyError, SecretUnavailable, load_box, reseal_all

    try:
        old = load_box(os.environ.get("FEDSWARM_SECRET_KEY"), create=False)
        new_env = os.environ.get("FEDSWARM_NEW_SECRET_KEY")
        if new_env:
            new = SecretBox(new_env, "$FEDSWARM_NEW_SECRET_KEY")
        elif new_key_file is not None:
            new = load_box(key_file=new_key_file)
        else:
            fail("give the new key: --new-key-file PATH or $FEDSWARM_NEW_SECRET_KEY")
    except SecretKeyError as exc:
        fail(str(exc))
    if new.key_id == old.key_id:
        fail(f"the new key is the current one ({old.source})")
    store = Store(db)
    try:
        n = reseal_all(store, old, new)
    except SecretUnavailable as exc:
        fail(f"nothing changed: {exc}", code=1)
    typer.echo(f"re-sealed {n} webhook secret(s) of {store.url} under key {new.key_id} ({new.source}); "
               f"start the dashboards with that key")
