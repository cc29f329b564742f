"""``python -m hpipe.model.kernels [-v]``: build the CPU decode kernel into the cache (setup runs it)."""

import logging
import sys

from hpipe.model import cpu_kernel

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(f"built {cpu_kernel.build(verbose='-v' in sys.argv)}")
except (OSError, RuntimeError) as err:  # no compiler or ninja: stages decode eagerly
    print(f"the CPU decode kernel was not built ({err}); stages will decode eagerly", file=sys.stderr)
