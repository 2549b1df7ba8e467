"""Root conftest: fixtures shared by tests/ and bench/."""
import zlib

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def seed(request) -> int:
    """A seed of this test's own (stable per test id, different between tests), so every
    check draws fresh data and a failure replays."""
    return zlib.crc32(request.node.nodeid.encode())
