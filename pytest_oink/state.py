"""The session's shared state, stashed on the pytest config (the plugin's hooks, the bench runner
and the xdist hooks all read it; none of them imports another for it)."""
from __future__ import annotations

import pytest

ROWS = pytest.StashKey[list]()  # benchmark rows measured (or merged from xdist workers)
STATE = pytest.StashKey[dict]()  # roofline, baseline, gate results, files written
CASES = pytest.StashKey[object]()  # the suite's cases, when a suite runs
