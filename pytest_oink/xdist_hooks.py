"""pytest-xdist hooks (registered only when xdist is active): collect workers' benchmark rows."""
from __future__ import annotations

import json

from .state import ROWS


def pytest_testnodedown(node, error):
    payload = getattr(node, "workeroutput", {}).get("oink_rows")
    if payload:
        from .report import Row

        for r in json.loads(payload)["rows"]:
            r.pop("tbs", None)
            node.config.stash[ROWS].append(Row(**r))
