"""Evaluate a ToolQA-style prompt set; the same as `chunk-llama eval` (see --help).

    python scripts/eval_toolqa.py --output runs/toolqa --check-parity 8
    accelerate launch --num_processes 2 scripts/eval_toolqa.py --output runs/toolqa
    (CPU only: accelerate launch --multi_gpu --num_processes 2 ...)
"""

import sys

from chunk_llama.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
