"""The peers' providers, one module a library (``quack``, ``liger``, ``flashinfer``), Oink's unfused compositions
(``oink_unfused``) and the QK norm + rotary embedding's peers (``rope``: vLLM's op, Oink unfused): each records its
builders on its ``Peer``; ``register`` puts them all in the registry (``pytest_oink.providers.specs`` calls it
once). Importing a module here registers nothing."""
from __future__ import annotations

from . import flashinfer, liger, oink_unfused, quack, rope

PEERS = (quack.QUACK, liger.LIGER, flashinfer.FLASHINFER, oink_unfused.OINK_UNFUSED, rope.VLLM)


def register() -> None:
    """Every peer's builders into ``registry.PROVIDERS`` (and their labels into ``LABELS``)."""
    for p in PEERS:
        p.register()
