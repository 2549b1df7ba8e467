"""The one table of tolerances, (op family, output dtype name) -> (atol, rtol): ``oink.measure.tolerances``
(the tuner gates with it too), re-exported here for the plugin and the tests."""
from __future__ import annotations

from oink.measure.tolerances import FAMILIES, tolerance  # noqa: F401  (re-exported for the plugin's modules and tests)
