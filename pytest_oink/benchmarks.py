"""Benchmark tests, parametrized from the suite registry (pytest_oink.suites) by the plugin.

Not run without ``--oink-suite=NAME``. Each item gates one provider's output against the fp32
reference on 3 seeded inputs, then times it (CUDA-graph replay on a GPU)."""


def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
