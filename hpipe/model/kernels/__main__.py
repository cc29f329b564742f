"""``python -m hpipe.model.kernels [-v]``: build the CPU kernels into the cache (setup runs it).

Where a C++ compiler exists, a build that fails is an error (exit 1, with the compiler's own
message): set-up must not go on to leave every quantized model unloadable. Without a compiler it
says in one line what runs slower and why, and exits 0 (hpipe still runs: see :mod:`hpipe.model.kernels.library`).
"""

import logging
import subprocess
import sys

from hpipe.model.kernels import library

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(f"built {library.build(verbose='-v' in sys.argv)}")
except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as err:
    if library.compiler() is not None:
        print(f"hpipe's CPU kernels failed to build with {library.compiler()}:\n{err}", file=sys.stderr)
        sys.exit(1)
    print("no C++ compiler here (install g++, or set CXX): hpipe's CPU kernels were not built, so float32 "
          "stages decode several times slower and quantized (GGUF) models load only with --dequantize",
          file=sys.stderr)
