"""``fedswarm client`` and ``fedswarm dashboard``: the two long-running services a deployment
starts (a Flower SuperNode running fedswarm's ClientApp, and the web dashboard). Mounted on
the ``fedswarm`` app by :mod:`fedswarm.cli`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from fedswarm.cli_common import DB_HELP, fail

__all__ = ["client", "dashboard"]


def client(
    superlink: str = typer.Option(..., "--superlink", help="The SuperLink's Fleet API address, HOST:PORT."),
    partition_id: int = typer.Option(0, "--partition-id", min=0, help="Which data partition this node trains on."),
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
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the flower-supernode command and exit."),
) -> None:
    """Join a federation: start a Flower SuperNode that runs fedswarm's ClientApp."""
    from fedswarm.client.supernode import supernode_command

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
                                state_dir=state_dir, keep_runs=state_keep_runs)
    except ValueError as exc:
        fail(str(exc))
    if dry_run:
        print(" ".join(cmd))
        return
    # The SuperNode's SuperExec looks for a new ClientApp task every second by default: a quarter
    # of a second takes most of that wait off every round (set the variable to choose).
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.25")
    os.execvp(cmd[0], cmd)


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
) -> None:
    """Open the web dashboard: start, watch, pause and stop runs; see every node.

    The admin account is created at first start: its password is $FEDSWARM_ADMIN_PASSWORD,
    or a generated one printed once. The API reference is at /docs (served offline)."""
    if (certfile is None) != (keyfile is None):
        fail("--certfile and --keyfile go together")
    try:
        from fedswarm.web.app import proxy_options
        from fedswarm.web.app import run as run_dashboard
    except ImportError as exc:
        fail(f"the dashboard is not available: {exc}", code=1)
    try:
        proxy_options(behind_proxy, trusted_proxies)
    except ValueError as exc:
        fail(f"--trusted-proxies: {exc}")
    run_dashboard(host=host, port=port, db=db, superlink=superlink, https=https, behind_proxy=behind_proxy,
                  trusted_proxies=trusted_proxies,
                  certfile=str(certfile) if certfile else None, keyfile=str(keyfile) if keyfile else None,
                  report_timeout_s=report_timeout)
