"""``python -m parallax.cli``: the ``parallax`` command without the console script (tests, subprocesses)."""

from parallax.cli.entry import run

run()
