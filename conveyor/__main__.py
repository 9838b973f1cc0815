"""``python -m conveyor``: the same as the ``conveyor`` command."""

from conveyor.entrypoints.cli import run

run()
