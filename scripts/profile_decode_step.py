"""Where a one-request decode step's wall time goes on the CPU: the C stack, the LM head, and
each Python piece around them, as exclusive microseconds per step.

    python scripts/profile_decode_step.py                                  # the default model
    python scripts/profile_decode_step.py --model path/to/1b.gguf --new-tokens 64

One request (a `--prompt-tokens` prompt, `--new-tokens` greedy tokens, EOS masked as
`bench_single.py` masks it), decoded twice; the second run's steps are reported. Each listed
function is wrapped by a timer that subtracts the time of the wrapped functions it calls, so a
row is that function's own time (its torch ops included), "(other)" marking a caller's rest.
The timers add about 1 us per call. A profile, not a benchmark: the whole step is timed by
`bench_single.py`.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import time

from transformers import GenerationConfig

import chunk_llama
from chunk_llama.loading import load_model

# (module, class or None, attribute, label)
PIECES = [
    ("chunk_llama.engine.engine", "ChunkLlamaEngine", "step", "engine.step (other)"),
    ("chunk_llama.engine.runner", "ModelRunner", "_decode", "runner._decode (other)"),
    ("chunk_llama.engine.runner", "ModelRunner", "_decode_forward", "runner._decode_forward (other)"),
    ("chunk_llama.engine.runner", None, "select_tokens", "select_tokens"),
    ("chunk_llama.engine.runner", "ModelRunner", "_apply", "runner._apply"),
    ("chunk_llama.hf.cache", "ChunkCache", "begin_decode", "cache.begin_decode (other)"),
    ("chunk_llama.hf.cache", "ChunkCache", "end_step", "cache.end_step"),
    ("chunk_llama.step.builder", "StepBuilder", "_decode_plan", "builder._decode_plan"),
    ("chunk_llama.step.builder", "StepBuilder", "_context", "builder._context"),
    ("chunk_llama.step.builder", "StepBuilder", "_writes", "builder._writes"),
    ("chunk_llama.hf.fused.layers", None, "_fused", "fused layer 0 (other)"),
    ("chunk_llama.hf.fused.stack", None, "run", "fused stack (other)"),
    ("chunk_llama.hf.fused.snapshot", "Snapshot", "stale", "snapshot checks"),
    ("chunk_llama.ops.cpu.planned", "CpuPlanned", "decoder_stack", "C decoder stack"),
    ("chunk_llama.ops.cpu.quant_linear", "QuantLinear", "__call__", "LM head (C)"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or gemma3-270m (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=200)
    args = parser.parse_args()
    own = collections.defaultdict(float)
    open_calls: list[float] = []  # per open timer: the time of the timed calls inside it

    def timed(function, label):
        def wrapper(*a, **k):
            open_calls.append(0.0)
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                elapsed = time.perf_counter() - start
                own[label] += elapsed - open_calls.pop()
                if open_calls:
                    open_calls[-1] += elapsed
        return wrapper

    model, tokenizer = load_model(args.model)
    inner = model.model
    pieces = [*PIECES, (type(inner.embed_tokens), None, "forward", "embedding"),
              (type(inner.rotary_emb), None, "forward", "rotary embedding"),
              (type(inner.norm), None, "forward", "final norm")]
    for module, owner, name, label in pieces:
        target = importlib.import_module(module) if isinstance(module, str) else module
        target = getattr(target, owner) if owner else target
        setattr(target, name, timed(getattr(target, name), label))
    engine = chunk_llama.ChunkLlamaEngine(model, tokenizer, max_batch_size=1, retain_prefixes=False)
    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    prompt = [100 + i % 1000 for i in range(args.prompt_tokens)]
    for _ in range(2):
        engine.add_request(prompt, config)
        engine.step()  # the prefill
        own.clear()
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        total = (time.perf_counter() - start) * 1e6 / steps
    engine.close()
    print(f"# {args.model or 'default model'}: decode step {total:.0f} us, {steps} steps")
    print("| piece | us per step |\n|---|---|")
    for label, seconds in sorted(own.items(), key=lambda item: -item[1]):
        print(f"| {label} | {seconds * 1e6 / steps:.1f} |")
    print(f"| rest (untimed Python) | {total - sum(own.values()) * 1e6 / steps:.1f} |")


if __name__ == "__main__":
    main()
