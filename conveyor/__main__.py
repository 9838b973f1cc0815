"""``python -m conveyor``: the same as the ``conveyor`` command."""

import sys

from conveyor.entrypoints.cli import main

sys.exit(main())
