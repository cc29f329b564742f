#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the built-in default: the bundled SmolLM2 model
# analysing the bundled sample long document.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
hpipe demo "$@"
