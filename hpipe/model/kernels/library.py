"""hpipe's C++ CPU kernels as one library: built into the cache ahead of use where it can be
(``python -m hpipe.model.kernels``, run by ``scripts/setup.sh``: one directory per source, PyTorch
and Python version, ``$HPIPE_CACHE_DIR/kernels``), else by the first stage that asks
(:func:`available` builds it then, about a minute, logged), and loaded into the process as
``torch.ops.hpipe``. Where it cannot be built (no compiler), float32 stages decode eagerly and
quantized stages refuse to load (:func:`require`). ``HPIPE_CPU_KERNEL=off`` keeps stages off the
decode kernel (:mod:`hpipe.model.compute.stage_kernel`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

from hpipe.core.errors import ModelSourceError
from hpipe.core.paths import cache_root

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent
SOURCES = (KERNELS / "decode.cpp", KERNELS / "quant.cpp", KERNELS / "bf16_gemm.cpp",  # one library
           KERNELS / "bf16_attention.cpp", KERNELS / "f32_attention.cpp", KERNELS / "q8_dot.cpp",
           KERNELS / "legacy_dot.cpp")
ENV = "HPIPE_CPU_KERNEL"  # "off" disables it
_lock = threading.Lock()
_enabled = True
_vector = True  # attention through the AVX-512 or AVX2 loops where the CPU has them
_build_error = ""  # why the kernels could not be built or loaded here, if they could not


def name() -> str:
    """The library's name: it changes with the source, PyTorch and Python (a profile's grids, timed
    with these kernels, are keyed by it too: profiler.device.fingerprint)."""
    code = b"".join(f.read_bytes() for f in (*SOURCES, *sorted(KERNELS.glob("*.h"))))  # quant_loops.h too
    key = f"{code.hex()}:openmp:{torch.__version__}:{sys.version_info[:2]}"
    return "hpipe_decode_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_dir() -> Path:
    return cache_root() / "kernels" / name()


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (a no-op when it is up to date) and load it."""
    from torch.utils.cpp_extension import load

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    # PyTorch runs `ninja` from PATH: the one pip installed beside this Python, if no other
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bin_dir
    with _lock, open(path / "build.lock", "w") as guard:
        # one build a folder at a time, across processes, under a lock the OS frees when its holder
        # dies; PyTorch's own (a file "lock" it makes and deletes) is left behind by a build killed
        # half-way, and the next waited on it for ever: under ours, nobody else builds, so it goes
        fcntl.flock(guard, fcntl.LOCK_EX)
        (path / "lock").unlink(missing_ok=True)
        # -fopenmp: ATen's parallel_for is a header; compiled without OpenMP it runs on one thread
        load(name=name(), sources=[str(f) for f in SOURCES], build_directory=str(path),
             extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose)
    available.cache_clear()
    return path / f"{name()}.so"


def loaded() -> bool:
    """Whether the kernels are loaded into this process already (asking builds nothing)."""
    return hasattr(torch.ops.hpipe, "decode_units")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernels are loaded into this process: loaded from the cache on first ask, and
    built into it first where they are not yet (once per source and PyTorch; about a minute)."""
    global _build_error
    if loaded():
        return True
    library = build_dir() / f"{name()}.so"
    if not library.exists():
        log.warning("building hpipe's CPU kernels into %s (once, about a minute)", build_dir())
        try:
            build()
        except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as err:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            _build_error = next((line.strip() for line in lines if "error" in line.lower()), lines[-1])
            log.error("hpipe's CPU kernels could not be built (%s): float32 stages decode eagerly, several times "
                      "slower, and quantized weights cannot load", _build_error)
            return False
        return hasattr(torch.ops.hpipe, "decode_units")
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as err:  # a broken build: decode eagerly rather than fail
        _build_error = str(err)
        log.warning("the CPU kernels at %s do not load (%s); decode runs eagerly", library, err)
        return False
    return True


def build_error() -> str:
    """Why the kernels could not be built or loaded in this process ("" if they were, or nobody asked)."""
    return _build_error


def compiler() -> str | None:
    """The C++ compiler PyTorch would build the kernels with (``$CXX``, else ``c++``), if there is one."""
    return shutil.which(os.environ.get("CXX", "c++"))


def require(what: str) -> None:
    """Raise a clear error when the kernels cannot be had here (``what`` needs them)."""
    if not available():
        raise ModelSourceError(f"{what} needs hpipe's C++ CPU kernels, which could not be built here "
                               f"({_build_error or 'unknown error'}): install a C++ compiler (g++) and rerun, or "
                               "pass --dequantize to compute from float32 weights instead")


def enable(flag: bool) -> None:
    """Use the kernel where it fits (the default) or never (to compare against the eager path)."""
    global _enabled
    _enabled = flag


def vector_attention(flag: bool) -> None:
    """Attention through the kernel's AVX-512 or AVX2 loops where the CPU has them (the default), or
    through MKL's batched products as on other CPUs (to compare both)."""
    global _vector
    _vector = flag


def vector_attention_on() -> bool:
    """Whether attention runs through the kernel's AVX-512 or AVX2 loops (:func:`vector_attention`)."""
    return _vector


def switched_off() -> bool:
    """Whether ``HPIPE_CPU_KERNEL=off`` or :func:`enable` (False) turned the kernel off."""
    return not _enabled or os.environ.get(ENV, "").lower() == "off"


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a stage on ``device`` in ``dtype`` runs its decode micro-batches through the kernel."""
    return not switched_off() and device.type == "cpu" and dtype == torch.float32 and available()


