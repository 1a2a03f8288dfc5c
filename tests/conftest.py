import warnings

import pytest

from tests.helpers import free_port, wait_until  # noqa: F401  (re-exported for older test modules)

warnings.filterwarnings("ignore", category=UserWarning, module="flwr_datasets")


@pytest.fixture
def store(tmp_path):
    from fedswarm.store import Store

    s = Store(tmp_path / "store.db")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _flower_identity():
    """Flower messages need a task identity; engines set it, unit tests get a fixed one."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture
def hold_dir(tmp_path):
    """A folder through which a test holds and releases a run's training (tests.resume_helpers.HOLD_ENV)."""
    d = tmp_path / "hold"
    d.mkdir()
    return d
