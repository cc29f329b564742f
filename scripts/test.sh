#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on the CPU. GPU tests skip without a GPU.
# On a CPU with AVX-512, the tests of the kernels, models and pipelines (-m avx2_pass) then run a
# second time with the instruction set capped at AVX2, as most users' CPUs have it, so an AVX2
# path cannot break unseen. With arguments: one pass, pytest given them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -gt 0 ] || ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    exec .venv/bin/python -m pytest -q "$@"
fi
status=0
.venv/bin/python -m pytest -q || status=$?
echo "== the kernel, model and pipeline tests again, the instruction set capped at AVX2 (-m avx2_pass)"
. scripts/avx2.env
.venv/bin/python -m pytest -q -m avx2_pass || status=$?
exit $status
