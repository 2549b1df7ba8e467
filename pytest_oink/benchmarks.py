"""The benchmark suites' test items: the one definition, shipped in the package so that
``pytest --oink-suite=NAME`` runs wherever pytest runs (a user's project, an empty directory,
this repository's root or ``bench/``). The plugin collects this module itself when a suite is
given (plugin.suite_items); it is parametrized from the suite registry (pytest_oink.suites).

Each item gates one provider's output against the fp32 reference on 3 seeded inputs, then
times it (CUDA-graph replay on a GPU)."""


def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
