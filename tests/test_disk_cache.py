"""The on-disk compile cache (oink/kernels/disk_cache.py), on a CPU: a compiled kernel is stored,
a fresh in-memory cache (a new process, in effect) loads it instead of compiling, a corrupt entry
is rebuilt, and the entry's name changes with the kernel sources. Launching a loaded function needs
a GPU: the last test (marked gpu) does."""
from __future__ import annotations

import pytest

from oink import config

pytestmark = pytest.mark.skipif(not config.get().tvm_ffi, reason="the disk cache holds TVM-FFI functions only")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OINK_CACHE_DIR", str(tmp_path))
    config.reload()
    from oink.kernels.compile import CACHE

    CACHE.clear()
    yield tmp_path
    CACHE.clear()


def _compile():
    from oink.kernels.softmax import compiled_softmax
    from oink.kernels.softmax_rules import SoftmaxKey

    return compiled_softmax(SoftmaxKey("forward", "bfloat16", 4096, "sm_90a"))


def test_a_fresh_cache_loads_instead_of_compiling(cache_dir):
    import tvm_ffi

    from oink.kernels.compile import CACHE

    _compile()
    entries = list(cache_dir.glob("oink_*.o"))
    assert len(entries) == 1 and entries[0].stat().st_size > 0
    assert not list(cache_dir.glob(".*"))  # no temporary file left behind
    compiles = CACHE.compiles
    CACHE.clear()  # what a new process starts with
    fn = _compile()
    assert CACHE.compiles == compiles  # nothing compiled
    assert isinstance(fn, tvm_ffi.Function)


def test_a_corrupt_entry_is_rebuilt(cache_dir):
    from oink.kernels.compile import CACHE

    _compile()
    (entry,) = cache_dir.glob("oink_*.o")
    entry.write_bytes(b"not an object file")
    CACHE.clear()
    compiles = CACHE.compiles
    _compile()
    assert CACHE.compiles == compiles + 1
    assert entry.stat().st_size > 100  # replaced by a good export


def test_the_name_follows_the_sources_and_the_key(monkeypatch):
    from oink.kernels import disk_cache

    key = (("softmax", "forward", "bfloat16", 4096, "sm_90a"), True)
    before = disk_cache.entry_name(key)
    assert before.isidentifier() and before == disk_cache.entry_name(key)
    assert disk_cache.entry_name(key[:1] + (False,)) != before
    monkeypatch.setattr(disk_cache, "fingerprint", lambda: "another kernel source")
    assert disk_cache.entry_name(key) != before


def test_on_by_default_in_the_user_cache_and_off_when_asked(monkeypatch, tmp_path):
    from oink.kernels import disk_cache

    monkeypatch.delenv("OINK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config.reload()
    assert disk_cache.directory() == tmp_path / "oink" / "kernels"
    for off in ("0", "off", ""):
        monkeypatch.setenv("OINK_CACHE_DIR", off)
        config.reload()
        assert disk_cache.directory() is None


@pytest.mark.gpu
@pytest.mark.sm(90)
def test_a_loaded_kernel_launches_like_the_compiled_one(cache_dir):
    import torch

    import oink
    from oink.kernels.compile import CACHE

    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    want = torch.softmax(x.float(), -1)
    first = oink.softmax_forward(x)  # compiled and stored
    CACHE.clear()
    compiles = CACHE.compiles
    second = oink.softmax_forward(x)  # loaded from the disk
    assert CACHE.compiles == compiles
    for y in (first, second):
        torch.testing.assert_close(y.float(), want, atol=2e-3, rtol=2e-2)
