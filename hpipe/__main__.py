"""``python -m hpipe``: the ``hpipe`` command."""

import sys

from hpipe.app.cli import main

sys.exit(main())
