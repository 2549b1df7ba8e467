"""The machine a baseline was measured on against this one (issue #34 item 3). Times from another
GPU, driver, CUDA, torch or CuTeDSL say nothing about a kernel change: such a baseline is refused
before anything is timed, unless ``--oink-accept-machine``. Oink's own version differing is what
a regression gate is for, and peers' versions only move peers' rows: those are reported only."""
from __future__ import annotations

import pytest

from . import options
from .state import STATE

IDENTITY = ("GPU", "driver", "CUDA", "torch", "CuTeDSL")


def identity(info: dict) -> dict | None:
    """The IDENTITY fields of a machine_info (as fill_machine_info writes it); None where it names no
    machine (our rows JSON), a field None where it is not recorded."""
    if not info or ("gpu" not in info and "oink_versions" not in info):
        return None
    gpu, versions = info.get("gpu") or {}, info.get("oink_versions") or {}
    name = (gpu.get("name") if gpu else "no GPU") if "gpu" in info else None
    return {"GPU": name, "driver": gpu.get("driver"), "CUDA": gpu.get("cuda"), "torch": versions.get("torch"),
            "CuTeDSL": versions.get("nvidia-cutlass-dsl")}


def describe(ident: dict | None) -> str:
    if ident is None:
        return "not recorded (the file names no machine)"
    return ", ".join(v if k == "GPU" else f"{k} {v}" for k, v in ident.items() if v) or "not recorded"


def mismatches(baseline: dict | None, here: dict | None) -> list[str]:
    """The IDENTITY fields that both machines record and that differ, as "field old -> new"."""
    if baseline is None or here is None:
        return []
    return [f"{k} {baseline[k]} -> {here[k]}" for k in IDENTITY if baseline[k] and here[k] and baseline[k] != here[k]]


def this_machine() -> dict:
    info: dict = {}
    fill_machine_info(info)
    return info


def fill_machine_info(machine_info: dict) -> None:
    """GPU name, capability, driver and library versions into ``machine_info`` (pytest-benchmark's, where
    --benchmark-json writes it: benchmark_hooks; or this_machine's)."""
    import importlib.metadata as md

    info = {}
    for pkg in ("torch", "nvidia-cutlass-dsl", "quack-kernels", "liger-kernel", "flashinfer-python", "triton", "oink"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    machine_info["oink_versions"] = info
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            machine_info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                                   "multiprocessors": p.multi_processor_count, "memory_bytes": p.total_memory,
                                   "cuda": torch.version.cuda, "driver": _driver_version()}
        else:
            machine_info["gpu"] = None
    except Exception as e:  # noqa: BLE001  (machine info must never fail a session)
        machine_info["gpu_error"] = repr(e)


def _driver_version():
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def check_baseline(config, path: str, baseline_info: dict) -> None:
    """Record both machines for the summaries; refuse (UsageError) a baseline from another one."""
    from .report import machine_differences

    here_info = this_machine()
    base, here = identity(baseline_info), identity(here_info)
    state = config.stash[STATE]
    state["machines"] = (describe(base), describe(here))
    state["machine_mismatch"] = mismatches(base, here)
    # the rest (Oink's and the peers' versions) is reported, not refused
    state["machine_differences"] = [d for d in machine_differences(baseline_info, here_info)
                                    if d.split(" ")[0] not in ("GPU", "torch", "nvidia-cutlass-dsl")]
    if state["machine_mismatch"] and not options.get(config, "--oink-accept-machine"):
        raise pytest.UsageError(
            f"--oink-baseline={path}: measured on another machine ({'; '.join(state['machine_mismatch'])}); its "
            f"times don't compare with this run's.\n  baseline: {state['machines'][0]}\n  this run: "
            f"{state['machines'][1]}\n--oink-accept-machine gates against it anyway.")


def summary_line(config) -> str | None:
    machines = config.stash[STATE].get("machines")
    return f"Baseline machine: {machines[0]}; this machine: {machines[1]}" if machines else None
