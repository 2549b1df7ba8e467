"""``memo``: the cache of a launch rule or a compiled kernel, cleared by ``config.reload()``. No cutlass here, so
the rules modules can use it."""
from __future__ import annotations

import functools
from typing import Callable

from .. import config


def memo(fn: Callable) -> Callable:
    """``fn`` (a ``compiled_*`` function or a launch heuristic) cached on its positional arguments
    until ``config.reload()``: a launch with known dtypes and N costs one dict lookup, not the
    heuristic and the key building again. Keyword calls go straight through."""
    cache: dict = {}
    config.ON_RELOAD.append(cache.clear)

    @functools.wraps(fn)
    def cached(*args, **kwargs):
        if kwargs:
            return fn(*args, **kwargs)
        r = cache.get(args)
        if r is None:
            r = cache[args] = fn(*args)
        return r

    cached.cache_clear = cache.clear
    return cached
