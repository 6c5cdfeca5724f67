"""`chunk-llama` command line: `generate` (a shared system prompt, many questions), `eval` (prompt sets)
and `serve` (an OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from chunk_llama.errors import UsageError
from chunk_llama.eval.cli import add_eval_parser
from chunk_llama.extras import MissingExtraError, require
from chunk_llama.server.options import ChatArgs, DeployArgs, ServeArgs
from chunk_llama.settings import EngineArgs, HelpFormatter, add_arguments, from_namespace, option, run_command
from chunk_llama.version import __version__

EXAMPLES = os.path.join(os.path.dirname(__file__), "examples")
DEFAULT_SYSTEM = os.path.join(EXAMPLES, "toolqa_flights_system.txt")
DEFAULT_PROMPTS = os.path.join(EXAMPLES, "toolqa_flights_questions.txt")


@dataclass
class GenerateArgs:
    """What to generate: a shared system prompt and one request per question."""

    system_prompt: str = option(DEFAULT_SYSTEM, "file holding the shared system prompt")
    prompts: str = option(DEFAULT_PROMPTS, "questions: one per line, or JSONL with a prompt or question field")
    max_new_tokens: int = option(64, "most new tokens per request")
    temperature: float = option(0.0, "sampling temperature (0: greedy)")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches top_p")
    seed: int | None = option(None, "sample reproducibly: request i draws as stock generate after "
                                    "torch.manual_seed(seed + i)")
    limit: int | None = option(None, "use only the first N prompts")
    output: str | None = option(None, "write one JSON object per request to this file")


def read_prompts(path: str) -> list[str]:
    """One prompt per line of a text file, or the `prompt`/`question` field of each JSONL line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                record = json.loads(line)
                text = record.get("prompt", record.get("question"))
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: a JSONL prompt needs a 'prompt' or 'question' string")
                prompts.append(text)
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def sampling_config(args: GenerateArgs):
    """The requests' `GenerationConfig`: greedy at temperature 0, else sampled (a ValueError names
    a value transformers refuses)."""
    from transformers import GenerationConfig

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} and "
                         f"{args.top_p}")
    if args.temperature == 0:
        return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature,
                            top_p=args.top_p, top_k=0)


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import GenerationConfig

    engine_args, args = from_namespace(EngineArgs, args), from_namespace(GenerateArgs, args)
    with open(args.system_prompt, encoding="utf-8") as f:
        system = f.read().strip()
    questions = read_prompts(args.prompts)
    if args.limit is not None:
        if args.limit < 1:
            raise UsageError(f"--limit must be at least 1 (the first N prompts), got {args.limit}")
        questions = questions[: args.limit]
    config = sampling_config(args)  # (its checks before the model loads)
    model, tokenizer = engine_args.load()
    engine = engine_args.build_engine(model, tokenizer)
    print(engine.describe(), file=sys.stderr)
    messages = [
        ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        for q in questions
    ]
    if args.seed is not None:  # one seed per request, so every request draws its own sample
        config = [GenerationConfig(**{**config.to_dict(), "seed": args.seed + i}) for i in range(len(messages))]
    start = time.perf_counter()
    try:
        outputs = engine.generate(messages, config, progress=True)
    except ValueError as error:  # a request the engine refuses (checked before any is run): the input's fault
        raise UsageError(str(error)) from error
    elapsed = time.perf_counter() - start

    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for question, out in zip(questions, outputs):
                record = {
                    "id": out.request_id,
                    "question": question,
                    "output": out.text,
                    "finish_reason": out.finish_reason,
                    "num_prompt_tokens": len(out.prompt_token_ids),
                    "num_generated_tokens": len(out.token_ids),
                }
                f.write(json.dumps(record) + "\n")
    else:
        for question, out in zip(questions[:3], outputs):
            print(f"\n> {question}\n{out.text}")

    stats = engine.stats
    num_generated = sum(len(o.token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    reused = stats["prefill_tokens_reused"]
    held, unshared = stats["peak_kv_bytes"], stats["peak_unshared_kv_bytes"]
    print("\n== chunk-llama generate ==")
    print(f"requests            {len(outputs)}")
    print(f"prompt tokens       {num_prompt} ({reused} reused from the cache, sharing ratio {reused / num_prompt:.1%})")
    print(f"generated tokens    {num_generated} in {elapsed:.1f} s ({num_generated / elapsed:.1f} tokens/s)")
    print(f"peak KV held        {_format_bytes(held)} vs {_format_bytes(unshared)} with one copy per request "
          f"({held / max(unshared, 1):.1%})")
    print(f"peak batch size     {stats['peak_batch_size']}, plan rebuilds {stats['plan_rebuilds']}, "
          f"decode steps {stats['decode_steps']}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`chunk-llama serve`: the OpenAI-compatible server (chunk_llama.server)."""
    require("serve", "chunk-llama serve")
    from chunk_llama.server import serve

    engine_args, serve_args = from_namespace(EngineArgs, args), from_namespace(ServeArgs, args)
    deploy, chat = from_namespace(DeployArgs, args), from_namespace(ChatArgs, args)
    if serve_args.data_parallel > 1 or serve_args.worker_urls:
        require("router", "chunk-llama serve --data-parallel/--worker-urls")
        from chunk_llama.server.replicas import serve_replicas

        serve_replicas(engine_args, serve_args, deploy, chat)
    else:
        serve(engine_args, serve_args, deploy, chat)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunk-llama", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"chunk-llama {__version__}")
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="batch generation with a shared system prompt", formatter_class=HelpFormatter)
    add_arguments(gen, EngineArgs, GenerateArgs)
    gen.set_defaults(func=cmd_generate)
    add_eval_parser(sub)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine", formatter_class=HelpFormatter)
    add_arguments(srv, EngineArgs, ServeArgs, DeployArgs, ChatArgs)
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # bare `chunk-llama`: what it can do, not a run
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        return run_command(parser, args)
    except MissingExtraError as error:  # one line naming the extra, not an import's traceback
        parser.exit(1, f"{parser.prog} {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
