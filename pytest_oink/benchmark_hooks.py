"""pytest-benchmark hooks (registered only when pytest-benchmark is installed)."""
from __future__ import annotations


def pytest_benchmark_update_machine_info(config, machine_info):
    """GPU name, capability, driver and library versions in --benchmark-json's machine_info."""
    from .machine import fill_machine_info

    fill_machine_info(machine_info)


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
