"""Root conftest: fixtures shared by tests/ and bench/, and the Hypothesis profile."""
import atexit
import os
import shutil
import tempfile
import zlib

import pytest
from hypothesis import settings

from pytest_oink.strategies import register_profiles

pytest_plugins = ["pytester"]

# The compile cache on disk: a fresh directory each session (set before oink reads its config), which
# the xdist workers inherit with the environment, so a kernel variant compiles once a session, in the
# worker that meets it first, and the others load it; nothing is loaded from an earlier session. A
# session that names OINK_CACHE_DIR keeps its own (its tests set temporary ones).
if "OINK_CACHE_DIR" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="oink-test-kernels-")
    os.environ["OINK_CACHE_DIR"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, True)


def pytest_configure(config):
    """Under ``-n`` each xdist worker (and the pytest runs it starts) keeps torch to one thread: the
    workers already fill the cores, and two threads per worker mostly spin waiting for a core."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        for knob in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(knob, "1")


# Small, derandomized runs by default (stable CI); `--hypothesis-profile=oink-gpu` for more.
register_profiles()
settings.load_profile("oink-ci")


def pytest_ignore_collect(collection_path, config):
    """With --oink-suite the session runs benchmarks only: the unit tests are not even collected
    (the plugin would deselect them after collection, which imports every test module). Without a GPU,
    a module whose every test needs one is not collected either (unless named on the command line):
    its thousands of items would each only skip; the terminal summary names the modules once."""
    from pytest_oink import options

    if (config.rootpath / "tests") in collection_path.parents and options.get(config, "--oink-suite"):
        return True
    if collection_path in _gpu_modules_left_out(config):
        return True
    return None


def gpu_only_modules(root) -> list:
    """tests/ modules with a module-level ``pytestmark`` naming ``pytest.mark.gpu`` (read from the source,
    not imported)."""
    import ast

    return [path for path in sorted((root / "tests").glob("test_*.py"))
            if any(_marks_all_gpu(node) for node in ast.parse(path.read_text()).body)]


def _gpu_modules_left_out(config) -> set:
    """The GPU-only modules, when this machine has no GPU for them; none that the command line names."""
    from pathlib import Path

    from pytest_oink.markers import device_capability

    if not hasattr(config, "_oink_gpu_modules_left_out"):
        found = set()
        if device_capability() is None:
            named = {Path(str(a).split("::")[0]).resolve() for a in config.args}
            found = {p for p in gpu_only_modules(config.rootpath) if p.resolve() not in named}
        config._oink_gpu_modules_left_out = found
    return config._oink_gpu_modules_left_out


def _marks_all_gpu(node) -> bool:
    """``pytestmark = ...`` naming ``pytest.mark.gpu`` (alone or in a list)."""
    import ast

    return (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
            and any(isinstance(n, ast.Attribute) and n.attr == "gpu" and getattr(n.value, "attr", None) == "mark"
                    for n in ast.walk(node.value)))


def pytest_terminal_summary(terminalreporter, config):
    left_out = _gpu_modules_left_out(config)
    if left_out:
        terminalreporter.write_line(
            f"not collected: {len(left_out)} modules whose every test needs a CUDA GPU (none is available): "
            + ", ".join(sorted(p.name for p in left_out)))


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
