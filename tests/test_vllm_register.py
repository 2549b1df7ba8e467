"""oink.register, vLLM's general-plugin hook (#33 item 10): either of vLLM's switches turns it on,
and it never raises into vLLM's start-up."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import oink

SWITCHES = ("VLLM_USE_OINK_OPS", "VLLM_USE_OINK_RMSNORM")

CHECK = """
import sys, oink
first, second = oink.register(), oink.register()
import torch
names = ('rmsnorm', 'fused_add_rms_norm', 'rms_norm_static_fp8_quant', 'fused_add_rms_norm_static_fp8_quant',
         'rms_norm_dynamic_per_token_quant', 'rms_norm_per_block_quant', 'per_token_group_fp8_quant')
print(first, second, all(hasattr(torch.ops.oink, n) for n in names), 'vllm' in sys.modules)
"""


def _run(code: str, **env) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("env,expected", [
    ({}, "False False False False"),
    ({"VLLM_USE_OINK_OPS": "1"}, "True True True False"),  # vLLM >= 0.33's switch
    ({"VLLM_USE_OINK_OPS": "on"}, "True True True False"),
    ({"VLLM_USE_OINK_OPS": "0"}, "False False False False"),
    ({"VLLM_USE_OINK_RMSNORM": "1"}, "True True True False"),  # the earlier switch
    ({"VLLM_USE_OINK_OPS": "0", "VLLM_USE_OINK_RMSNORM": "1"}, "True True True False"),  # either suffices
    ({"VLLM_USE_OINK_OPS": "1", "VLLM_USE_OINK_RMSNORM": "0"}, "True True True False"),
    ({"VLLM_USE_OINK_OPS": "", "VLLM_USE_OINK_RMSNORM": "false"}, "False False False False"),
])
def test_register_honours_both_vllm_switches(env, expected):
    assert _run(CHECK, **env) == expected


@pytest.fixture
def unregistered(monkeypatch):
    """This process's oink as if register had not run yet (the ops stay defined: register only
    imports them)."""
    monkeypatch.setattr(oink, "_registered", False)
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _boom(*a, **k):
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("switch", SWITCHES)
def test_register_in_process_reads_each_switch(unregistered, monkeypatch, switch):
    assert oink.register() is False
    monkeypatch.setenv(switch, "1")
    assert oink.register() is True and oink.register() is True


@pytest.mark.parametrize("where", ("switch", "ops_import"))
def test_register_never_raises_into_vllm(unregistered, monkeypatch, caplog, where):
    """A failure inside register (reading the switch, importing the ops) is a logged warning and
    False, never an exception into vLLM's start-up."""
    monkeypatch.setenv("VLLM_USE_OINK_OPS", "1")
    if where == "switch":
        from oink import config

        monkeypatch.setattr(config, "truthy", _boom)
    else:  # the ops' import fails (e.g. a broken torch or CUDA install)
        monkeypatch.delattr(oink, "ops", raising=False)
        monkeypatch.setitem(sys.modules, "oink.ops", None)  # import oink.ops -> ImportError
    with caplog.at_level(logging.WARNING, logger="oink"):
        assert oink.register() is False
    warned = [r for r in caplog.records if r.name == "oink" and r.levelno == logging.WARNING]
    assert warned and "not registered" in warned[0].getMessage(), caplog.text
    assert oink._registered is False  # a later call tries again


def test_register_failure_in_a_fresh_process_keeps_going():
    """The start-up vLLM sees: register's failure is a warning on stderr, the caller carries on."""
    code = ("import sys, oink; sys.modules['oink.ops'] = None\n"
            "print(oink.register(), oink.register(force=True))")
    full_env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    out = subprocess.run([sys.executable, "-c", code], env={**full_env, "VLLM_USE_OINK_OPS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"
    assert "oink.register: torch.ops.oink.* not registered" in out.stderr
