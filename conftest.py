"""Root conftest: fixtures shared by tests/ and bench/, and the Hypothesis profile."""
import os
import zlib

import pytest
from hypothesis import settings

from pytest_oink.strategies import register_profiles

pytest_plugins = ["pytester"]

# Hermetic tests: the compile cache on disk stays off unless a session names one (its own tests set
# a temporary directory); set before oink reads its config.
os.environ.setdefault("OINK_CACHE_DIR", "0")

# Small, derandomized runs by default (stable CI); `--hypothesis-profile=oink-gpu` for more.
register_profiles()
settings.load_profile("oink-ci")


def pytest_ignore_collect(collection_path, config):
    """With --oink-suite the session runs benchmarks only: the unit tests are not even collected
    (the plugin would deselect them after collection, which imports every test module)."""
    from pytest_oink import options

    if (config.rootpath / "tests") in collection_path.parents and options.get(config, "--oink-suite"):
        return True
    return None


@pytest.fixture(autouse=True)
def _oink_config_follows_the_environment():
    """Tests that set an OINK_* knob call oink.config.reload(); after monkeypatch restores the
    environment (its teardown runs before this one's), the config is read back from it."""
    yield
    import sys

    if "oink.config" in sys.modules:
        sys.modules["oink.config"].reload()


@pytest.fixture(autouse=True)
def _gpu_memory_back_to_the_pool():
    """Under pytest-xdist several workers share one GPU: each test hands its cached blocks back,
    so a worker's idle cache does not make another's allocation fail."""
    yield
    import os
    import sys

    torch = sys.modules.get("torch")
    if os.environ.get("PYTEST_XDIST_WORKER") and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def seed(request) -> int:
    """A seed of this test's own (stable per test id, different between tests), so every
    check draws fresh data and a failure replays."""
    return zlib.crc32(request.node.nodeid.encode())
