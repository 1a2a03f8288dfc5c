"""``fedswarm client``: a Flower SuperNode running fedswarm's ClientApp.

The SuperNode receives fedswarm's Flower App from the SuperLink when a run starts
(``flwr run .``) and executes ``fedswarm.client.app:app`` from this installation; its
node config tells the ClientApp which partition (or, with ``--data``, which dataset of its
own) to train on and which device class it is.

A secure deployment (``fedswarm certs``) passes the CA as ``root_certificates`` (the
SuperLink's certificate is verified against it) and the node's authentication key
(``auth_private_key``, an OpenSSH ECDSA key whose public half the operator registered
with ``flwr supernode register``): the SuperLink then refuses every node it does not know.

The ClientApp keeps the node's own state (error-feedback residuals, replicas, a decentralized
node's model) in ``--state-dir`` after every round, so that ``fedswarm resume`` continues a
run exactly (:mod:`fedswarm.client.state_store`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from fedswarm.client.state_store import KEEP_RUNS_KEY, default_state_dir
from fedswarm.probe import probe_device_class

__all__ = ["supernode_command", "node_config_string"]


def node_config_string(partition_id: int, num_partitions: int, device_class: str,
                       state_dir: Path | None = None, keep_runs: int | None = None, local=None,
                       device: str | None = None) -> str:
    """The SuperNode's ``--node-config``: partition, device class, the device probe, the
    folder the node keeps its own state in and how many runs' state it keeps (see
    :mod:`fedswarm.client.state_store`), the node's own dataset (``local``, a
    :class:`~fedswarm.tasks.localdata.LocalDataSpec`: ``data-path``, ``label-column``,
    ``val-fraction``) and the torch device it trains on (``device``: overrides the run
    config's, see :func:`fedswarm.local.run_config_of`)."""
    text = (f'partition-id={partition_id} num-partitions={num_partitions} device-class="{device_class}" '
            'probe="true"')
    if device is not None:
        text += f' device="{device}"'
    if state_dir is not None:
        text += f" state-dir={json.dumps(str(state_dir))}"
    if keep_runs is not None:
        text += f" {KEEP_RUNS_KEY}={int(keep_runs)}"
    if local is not None:
        text += (f" data-path={json.dumps(local.path)} label-column={json.dumps(local.label_column)}"
                 f" val-fraction={float(local.val_fraction)!r}")
    return text


def supernode_command(superlink: str, partition_id: int, num_partitions: int, *, device_class: str | None = None,
                      insecure: bool = False, root_certificates: Path | None = None,
                      clientappio_port: int | None = None, auth_private_key: Path | None = None,
                      state_dir: Path | None = None, keep_runs: int | None = None, local=None,
                      device: str | None = None) -> list[str]:
    """The ``flower-supernode`` command line for this node; ``state_dir`` (default: the
    per-user data folder) is where its ClientApp keeps the node's state between runs."""
    if insecure and (root_certificates is not None or auth_private_key is not None):
        raise ValueError("--insecure cannot be combined with --root-certificates or --auth-key")
    if auth_private_key is not None:
        _check_auth_key(Path(auth_private_key))
    exe = shutil.which("flower-supernode") or str(Path(sys.executable).with_name("flower-supernode"))
    cmd = [exe, "--superlink", superlink,
           "--node-config", node_config_string(partition_id, num_partitions, device_class or probe_device_class(),
                                               Path(state_dir or default_state_dir()).expanduser().resolve(),
                                               keep_runs, local, device)]
    if insecure:
        cmd.append("--insecure")
    if root_certificates is not None:
        cmd += ["--root-certificates", str(root_certificates)]
    if auth_private_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_private_key)]
    if clientappio_port is not None:
        cmd += ["--port", str(clientappio_port)]
    return cmd


def _check_auth_key(path: Path) -> None:
    """Refuse, before Flower does with a vaguer message, a key that is missing, readable by
    others, or not an OpenSSH EC private key (what ``fedswarm certs`` writes)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    if not path.is_file():
        raise ValueError(f"auth key {path} does not exist")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"auth key {path} is readable by others (mode {mode:o}); chmod 600 it")
    try:
        key = load_ssh_private_key(path.read_bytes(), None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"auth key {path} is not an OpenSSH EC private key (make one with `fedswarm certs supernode`)")
