"""pytest-xdist hooks (registered only when xdist is active): collect workers' benchmark rows."""
from __future__ import annotations

import json

from .state import ROWS, STATE


def pytest_testnodedown(node, error):
    note = getattr(node, "workeroutput", {}).get("oink_clock_note")
    if note:  # a worker's GPU whose clocks could not be read: said once by the controller
        node.config.stash[STATE].setdefault("clock_note", note)
    measured = getattr(node, "workeroutput", {}).get("oink_against")
    if measured:  # --oink-against: this worker's rows of the other tree, and the rows it could not time
        from .against import merge_worker_output

        merge_worker_output(node.config, measured)
    payload = getattr(node, "workeroutput", {}).get("oink_rows")
    if payload:
        from .report import Row

        for r in json.loads(payload)["rows"]:
            r.pop("tbs", None)
            node.config.stash[ROWS].append(Row(**r))
