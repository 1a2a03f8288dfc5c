"""``fedswarm client``: a Flower SuperNode running fedswarm's ClientApp.

The SuperNode receives fedswarm's Flower App from the SuperLink when a run starts
(``flwr run .``) and executes ``fedswarm.client.app:app`` from this installation; its
node config tells the ClientApp which partition to train on and which device class it is.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from fedswarm.probe import probe_device_class

__all__ = ["supernode_command", "node_config_string"]


def node_config_string(partition_id: int, num_partitions: int, device_class: str) -> str:
    return (f'partition-id={partition_id} num-partitions={num_partitions} device-class="{device_class}" '
            'probe="true"')


def supernode_command(superlink: str, partition_id: int, num_partitions: int, *, device_class: str | None = None,
                      insecure: bool = False, root_certificates: Path | None = None,
                      clientappio_port: int | None = None) -> list[str]:
    """The ``flower-supernode`` command line for this node."""
    exe = shutil.which("flower-supernode") or str(Path(sys.executable).with_name("flower-supernode"))
    cmd = [exe, "--superlink", superlink,
           "--node-config", node_config_string(partition_id, num_partitions, device_class or probe_device_class())]
    if insecure:
        cmd.append("--insecure")
    if root_certificates is not None:
        cmd += ["--root-certificates", str(root_certificates)]
    if clientappio_port is not None:
        cmd += ["--port", str(clientappio_port)]
    return cmd
