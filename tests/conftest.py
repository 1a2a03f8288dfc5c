import warnings

import pytest

from tests.helpers import free_port, wait_until  # noqa: F401  (re-exported for older test modules)

warnings.filterwarnings("ignore", category=UserWarning, module="flwr_datasets")


#: A test that starts real processes (Ray, a SuperLink, peers: ``@pytest.mark.integration``) or is
#: in the slow set (``@pytest.mark.slow``) waits on their start-up, which on a loaded 2-core machine
#: takes minutes: it gets this limit unless it sets its own with ``@pytest.mark.timeout``; every
#: other test keeps pyproject's 300 s.
INTEGRATION_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    cuda_skip = None
    for item in items:
        if item.get_closest_marker("cuda"):
            if cuda_skip is None:
                import torch

                cuda_skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here "
                                                    "(scripts/gpu-check runs these on one)")
                cuda_skip = False if torch.cuda.is_available() else cuda_skip
            if cuda_skip:
                item.add_marker(cuda_skip)
        long = item.get_closest_marker("integration") or item.get_closest_marker("slow")
        if long and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(INTEGRATION_TIMEOUT_S))


@pytest.fixture
def store(tmp_path):
    from fedswarm.store import Store

    s = Store(tmp_path / "store.db")
    yield s
    s.close()


@pytest.fixture(autouse=True, scope="session")
def _state_home(tmp_path_factory):
    """A run without --out writes Flower's log under $XDG_STATE_HOME (fedswarm.cli.common.log_file_for),
    and a dashboard makes its secret key file under $XDG_CONFIG_HOME (fedswarm.web.secret_box): the
    session's own folders, inherited by the processes tests start, not the user's home."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    patch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
    patch.delenv("FEDSWARM_SECRET_KEY", raising=False)
    patch.delenv("FEDSWARM_SECRET_KEY_FILE", raising=False)
    yield
    patch.undo()


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
