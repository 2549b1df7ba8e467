"""pytest-benchmark hooks (registered only when pytest-benchmark is installed)."""
from __future__ import annotations


def pytest_benchmark_update_machine_info(config, machine_info):
    """GPU name, capability, driver and library versions in --benchmark-json's machine_info."""
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


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """The suite and a random suite's seed at the file's top level: a results file says what it ran."""
    output_json["oink_run"] = run_info(config)


def run_info(config) -> dict:
    from . import modes, options, suites

    from .regression import no_rows_note

    suite = options.get(config, "--oink-suite")
    info = {"suite": suite, "seed": int(options.get(config, "--oink-seed")) if suite in suites.SEEDED else None,
            "timing": modes.for_suite(modes.parse(options.get(config, "--oink-timing")), suite)}
    note = no_rows_note(config)
    if note:  # a CI step reading the file learns why it holds no benchmarks (a GPU suite on a CPU runner)
        info["no_rows"] = note
    return info
