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
from dataclasses import dataclass

from chunk_llama.extras import require
from chunk_llama.settings import EngineArgs, HelpFormatter, add_arguments, from_namespace, option, run_command


@dataclass
class EvalArgs:
    """The prompt set and where results go."""

    output: str | None = option(None, "output folder (re-running resumes)", required=True)
    data: str = option("toolqa", "'toolqa' (shipped), a JSONL/CSV/Parquet file or a dataset folder")
    apps: list[str] | None = option(None, "only these applications")
    limit: int | None = option(None, "at most N questions per application")
    max_new_tokens: int = option(64, "most new tokens per answer")
    check_parity: int = option(0, "also run N requests with stock transformers generate and compare tokens",
                               metavar="N")
    constrained: bool = option(False, "decode each answer under a grammar of its app's tools (one Thought line, "
                                      "then Action: Tool[args] with the tool's number of arguments)")


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate a prompt set (ToolQA-style by default)", formatter_class=HelpFormatter)
    add_arguments(ev, EngineArgs, EvalArgs)
    ev.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    require("eval", "chunk-llama eval")
    import torch
    from accelerate import PartialState

    from chunk_llama.eval import EvalConfig, load_prompt_set, run_eval
    from chunk_llama.eval.summary import render_markdown

    engine_args, args = from_namespace(EngineArgs, args), from_namespace(EvalArgs, args)
    on_cpu = engine_args.device == "cpu" or (engine_args.device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=on_cpu)  # several CPU processes: gloo
    if on_cpu and state.num_processes > 1:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // state.num_processes))
    if not on_cpu and engine_args.device in ("auto", "cuda"):
        engine_args.device = str(state.device)  # each process its own GPU
    dataset = load_prompt_set(args.data, apps=args.apps, limit=args.limit)
    model, tokenizer = engine_args.load()
    config = EvalConfig(output_dir=args.output, max_new_tokens=args.max_new_tokens, check_parity=args.check_parity,
                        engine=engine_args, constrained=args.constrained)
    summary = run_eval(model, tokenizer, dataset, config, rank=state.process_index,
                       num_processes=state.num_processes, barrier=state.wait_for_everyone)
    if summary is not None:
        print(render_markdown(summary))
        print(f"wrote {args.output}/results.jsonl, summary.json and summary.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eval_toolqa", description=__doc__, formatter_class=HelpFormatter)
    add_eval_parser(parser.add_subparsers(dest="command"))
    return run_command(parser, parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)]))
