"""pytest-xdist hooks (registered only when xdist is active): collect workers' benchmark rows."""
from __future__ import annotations


def pytest_testnodedown(node, error):
    from .plugin import merge_worker_rows

    payload = getattr(node, "workeroutput", {}).get("oink_rows")
    if payload:
        merge_worker_rows(node.config, payload)
