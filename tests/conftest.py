import os
import socket
import warnings

import pytest

warnings.filterwarnings("ignore", category=UserWarning, module="flwr_datasets")


@pytest.fixture
def store(tmp_path):
    from fedswarm.store import Store

    s = Store(tmp_path / "store.db")
    yield s
    s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _flower_identity():
    """Flower messages need a task identity; engines set it, unit tests get a fixed one."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
