"""The old path of ``speccompile/exporters/tensorrt.py``: ``python -m speccompile.export_tensorrt ARTIFACT`` still works."""

import sys

from speccompile.exporters.tensorrt import *  # noqa: F401,F403
from speccompile.exporters.tensorrt import main

if __name__ == "__main__":
    sys.exit(main())
