"""Search launch shapes on this GPU and write them into the shipped table (oink/kernels/launch_table.json).

The search is ``oink.tune``'s (``python -m oink.tune`` writes a user's overlay instead); see its help:

    python3 scripts/tune_launch.py --ops rmsnorm_forward --widths 40960,98304 --rows 2048 --clusters 4,8,16
"""
import sys

from oink.kernels.launch_table import TABLE_PATH
from oink.tune import main

if __name__ == "__main__":
    sys.exit(main(default_out=TABLE_PATH))
