#!/usr/bin/env bash
# Install chunk-llama with the default model and run the main job: batch generation with a
# shared system prompt (the ToolQA-style example in chunk_llama/examples) on the default model.
# Arguments go to `chunk-llama generate` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/chunk-llama generate "$@"
