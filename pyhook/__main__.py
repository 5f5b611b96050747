"""``python -m pyhook``: the ``pyhook`` command (see :mod:`pyhook.cli`)."""

import sys

from .cli import main

sys.exit(main())
