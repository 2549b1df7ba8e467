"""pytest_oink: the pytest plugin that makes correctness gates and benchmarks one session.

Loaded through the ``pytest11`` entry point as ``pytest_oink.plugin``. Nothing here imports
torch at import time. To gate and time a kernel of your own, describe it with an ``OpSpec`` and
call the ``oink_measure`` fixture (docs/plugin.md: "Your own kernel")."""
from .providers import OpSpec

__all__ = ["OpSpec"]
