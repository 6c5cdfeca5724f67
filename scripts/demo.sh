#!/usr/bin/env bash
# Install everything and run the main job: batch generation with a shared system
# prompt (the ToolQA-style example in chunk_llama/examples) on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/chunk-llama generate "$@"
