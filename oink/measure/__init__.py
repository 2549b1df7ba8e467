"""What the tuner (``python -m oink.tune``) and the pytest plugin (``pytest_oink``) share to gate and time an op:
the tolerance table (``tolerances``), the correctness gate and the bench specs it gates (``gate``), and the
CUDA-graph timer (``timer``). Nothing here imports pytest or pytest_oink, nor torch at import: the plugin
imports these modules when pytest loads it, and ``import oink.tune`` works without the plugin's stack."""
