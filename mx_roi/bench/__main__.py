"""``python -m mx_roi.bench``: see :mod:`mx_roi.bench`."""
import sys

from .cli import main

sys.exit(main())
