"""``python -m hpipe``: the ``hpipe`` command."""

from hpipe.app.cli import console

console()
