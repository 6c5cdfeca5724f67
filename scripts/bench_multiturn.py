"""Multi-turn reuse: a 4-turn agent loop on one conversation, turn by turn.

    python scripts/bench_multiturn.py [--model PATH] [--turns 4] [--max-new-tokens 48] [--chunk-size 64]

The system prompt is the ToolQA flights manual (chunk_llama/examples/); turn 1 asks
a question, each later turn appends the assistant's reply (its text, as a chat
client would) and a new user message (a tool's "Observation: ..."). The engine is
given the whole message list every turn, as an OpenAI-style client sends it.

Per turn: prompt tokens, prompt tokens reused from the prefix cache and computed
(engine stats deltas), the share of the earlier turns' tokens (the previous
turn's prompt and reply) that was reused, and the time to first token.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import GenerationConfig

from chunk_llama.engine import ChunkLlamaEngine

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "chunk_llama", "examples")
OBSERVATIONS = [
    "Observation: Database loaded: 5,218 flights in 2022-02.",
    "Observation: AA 2306 DFW->MIA 2022-02-11 scheduled 07:05, departed 07:47, departure delay 42 minutes.",
    "Observation: Calculation result: 42.",
    "Observation: The task is not finished; answer with Finish[answer].",
]


def run_turns(engine, system: str, question: str, turns: int, config: GenerationConfig) -> list[dict]:
    """The agent loop; one row of figures per turn."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    rows, earlier = [], 0  # earlier: tokens of the previous turns (prompt + reply) the next turn starts with
    for turn in range(turns):
        before = engine.stats
        start = time.perf_counter()
        (out,) = engine.generate([list(messages)], config)
        after = engine.stats
        reused = after["prefill_tokens_reused"] - before["prefill_tokens_reused"]
        computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        rows.append(dict(turn=turn + 1, prompt=len(out.prompt_token_ids), reused=reused, computed=computed,
                         earlier=earlier, earlier_reused=min(1.0, reused / earlier) if earlier else None,
                         ttft=out.first_token_time - start, reply=out.text, finish=out.finish_reason,
                         last_ids=out.token_ids[-3:]))
        earlier = len(out.prompt_token_ids) + len(out.token_ids)
        messages += [{"role": "assistant", "content": out.text},
                     {"role": "user", "content": OBSERVATIONS[turn % len(OBSERVATIONS)]}]
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| turn | prompt tokens | reused | computed | earlier turns' tokens | % of earlier reused | "
             "TTFT ms |", "|" + "---|" * 7]
    for r in rows:
        share = "-" if r["earlier_reused"] is None else f"{r['earlier_reused']:.1%}"
        lines.append(f"| {r['turn']} | {r['prompt']} | {r['reused']} | {r['computed']} | {r['earlier']} | "
                     f"{share} | {r['ttft'] * 1000:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file, a local folder or a hub id (default model if omitted)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--show-replies", action="store_true")
    args = parser.parse_args()
    from chunk_llama.loading import load_model

    model, tokenizer = load_model(args.model, dtype=torch.float32)
    with open(os.path.join(EXAMPLES, "toolqa_flights_system.txt"), encoding="utf-8") as f:
        system = f.read()
    with open(os.path.join(EXAMPLES, "toolqa_flights_questions.txt"), encoding="utf-8") as f:
        question = f.readline().strip()
    engine = ChunkLlamaEngine(model, tokenizer, chunk_size=args.chunk_size)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False)
    rows = run_turns(engine, system, question, args.turns, config)
    print(render(rows))
    if args.show_replies:
        for r in rows:
            print(f"turn {r['turn']} ({r['finish']}, last ids {r['last_ids']}): {r['reply']!r}")
    later = [r["earlier_reused"] for r in rows[1:]]
    if later:
        print(f"\nlater turns reuse at least {min(later):.1%} of the earlier turns' tokens "
              f"(chunk size {engine.cache.chunk_size}); {engine.inputs.conversations.num_continued} prompts "
              "built from an earlier turn's ids (engine/conversation.py)")
    engine.close()


if __name__ == "__main__":
    main()
