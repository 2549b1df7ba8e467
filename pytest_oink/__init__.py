"""pytest_oink: the pytest plugin that makes correctness gates and benchmarks one session.

Loaded through the ``pytest11`` entry point as ``pytest_oink.plugin``. Nothing here imports
torch at import time."""
