"""Cost of grammar-constrained decoding per decode step on the CPU: xgrammar, llguidance and
outlines-core on the default model's tokenizer (SmolLM2, 49,152 ids), the numbers that chose
the engine's library (docs/ARCHITECTURE.md, "Structured output").

    python scripts/bench_grammar.py --batch 16 32 --repeat 5

Workload: every sequence of the batch is under the same JSON schema (a tool call's arguments:
strings, an enum, an integer, an array); each walks its own valid document (different values,
so the batch's matchers sit in different states), one token per step. A step is what the
engine's sampling step does for the batch: compute every row's token mask, apply the masks to
the `[batch, vocab]` float32 logits (the engine's way for every library: `apply_like_the_engine`),
and advance each matcher by its token. Reported: the
median ms per step over the walk (steps where every sequence still has a token) of the masks
and the matchers' advance (the library's part) and of the apply (the same for all), the first
compile of the schema (medians over rounds), and each library's batched fill where it has one (xgrammar's
`BatchGrammarMatcher`, llguidance's `fill_next_token_bitmask_par`, both threaded in native
code) beside the row-by-row fill. Run the libraries interleaved (A, B, C, A, B, C, ...):
the machine is shared, medians over rounds. Only llguidance is a dependency: install the
others by hand to compare (`pip install xgrammar outlines-core`; xgrammar brings triton,
about 1 GB); each one missing is left out with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import chunk_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["city", "date", "unit", "days", "fields"],
    "additionalProperties": False,
}
CITIES = ["Boston", "New York", "San Francisco", "Denver", "Paris", "Tokyo", "Lagos", "Lima"]
FIELDS = ["temperature", "humidity", "wind", "precipitation", "pressure", "uv index"]


def documents(n: int) -> list[str]:
    """`n` different valid documents of SCHEMA, written as a model would (compact JSON)."""
    docs = []
    for i in range(n):
        doc = {"city": CITIES[i % len(CITIES)] + ("" if i < len(CITIES) else f" {i}"),
               "date": f"2022-{1 + i % 12:02d}-{1 + i % 28:02d}", "unit": ["celsius", "fahrenheit"][i % 2],
               "days": 1 + i % 14, "fields": FIELDS[i % 3: i % 3 + 1 + i % 3]}
        docs.append(json.dumps(doc, separators=(",", ":")))
    return docs


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, batched: bool):
        import xgrammar as xgr

        self.xgr, self.batched = xgr, batched
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher() if batched else None

    def compile(self):
        return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def start(self, compiled, batch: int):
        self.matchers = [self.xgr.GrammarMatcher(compiled) for _ in range(batch)]
        self.mask = self.xgr.allocate_token_bitmask(batch, self.info.vocab_size)

    def step(self, tokens):
        if self.batched:
            self.batch.batch_fill_next_token_bitmask(self.matchers, self.mask)
        else:
            for i, m in enumerate(self.matchers):
                m.fill_next_token_bitmask(self.mask, i)
        for m, t in zip(self.matchers, tokens):
            assert m.accept_token(t)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, batched: bool):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.batched = llguidance, batched
        self.tok = llguidance.hf.from_tokenizer(tokenizer, vocab_size)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def compile(self):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                              defaults={"whitespace_flexible": False})
        return grammar, self.llg.LLMatcher(self.tok, grammar)  # the first matcher compiles it

    def start(self, compiled, batch: int):
        grammar = compiled[0]
        self.matchers = [self.llg.LLMatcher(self.tok, grammar) for _ in range(batch)]
        self.mask = self.llg.torch.allocate_token_bitmask(batch, self.vocab_size)

    def step(self, tokens):
        if self.batched:
            self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(self.matchers)],
                                                       self.mask)
        else:
            for i, m in enumerate(self.matchers):
                self.llg.torch.fill_next_token_bitmask(m, self.mask, i)
        for m, t in zip(self.matchers, tokens):
            assert m.consume_token(t), m.get_error()


class OutlinesCore:
    name = "outlines-core"
    batched = False

    def __init__(self, tokenizer, vocab_size: int, batched: bool):
        from outlines_core import Vocabulary

        self.vocab_size = vocab_size
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, _token_bytes(tokenizer))

    def compile(self):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), self.vocabulary)

    def start(self, compiled, batch: int):
        from outlines_core import Guide

        self.guides = [Guide(compiled) for _ in range(batch)]
        self.mask = torch.zeros(batch, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def step(self, tokens):
        row_bytes = self.mask.shape[1]
        for i, g in enumerate(self.guides):
            row = self.mask[i]
            g.write_mask_into(row.data_ptr(), row_bytes, 4)
        for g, t in zip(self.guides, tokens):
            g.advance(t)


def apply_like_the_engine(logits, mask):
    """Each row's mask as the engine applies it (`GrammarState.constrain`), the same for every
    library: their own appliers differ (xgrammar's CPU kernel 1.7 ms at batch 16, llguidance's
    needs torch.compile), and the engine does not use them."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
    with np.errstate(divide="ignore"):
        np.add(logits.numpy(), np.log(bits, dtype=np.float32), out=logits.numpy())


def _token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """Each token's bytes (byte-level BPE: GPT-2's byte-to-unicode map undone), as outlines-core takes them."""
    # GPT-2's printable stand-ins for bytes: the printable ones as themselves, the rest from U+0100 on
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    special = set(tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        out.setdefault(bytes(to_byte[c] for c in token), []).append(i)
    return out


def run_once(lib, docs_ids, vocab_size: int, batch: int) -> dict:
    start = time.perf_counter()
    compiled = lib.compile()
    compile_s = time.perf_counter() - start
    lib.start(compiled, batch)
    steps = min(len(ids) for ids in docs_ids)
    logits = torch.randn(batch, vocab_size)
    fill, apply = [], []
    for s in range(steps):
        start = time.perf_counter()
        lib.step([ids[s] for ids in docs_ids])
        fill.append(time.perf_counter() - start)
        work = logits.clone()
        start = time.perf_counter()
        apply_like_the_engine(work, lib.mask)
        apply.append(time.perf_counter() - start)
    return dict(fill_ms=statistics.median(fill) * 1e3, apply_ms=statistics.median(apply) * 1e3,
                compile_ms=compile_s * 1e3, steps=steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--repeat", type=int, default=5, help="rounds (libraries interleaved in each)")
    args = parser.parse_args()
    _, tokenizer = chunk_llama.load_default_model()
    vocab_size = len(tokenizer)
    libs = []
    for cls, batched in [(XGrammar, False), (XGrammar, True), (LLGuidance, False), (LLGuidance, True),
                         (OutlinesCore, False)]:
        try:
            libs.append(cls(tokenizer, vocab_size, batched))
        except ImportError as error:  # only llguidance is a dependency of chunk-llama
            print(f"{cls.name}: not installed ({error}), left out", flush=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"vocab {vocab_size}")
    print("| library | fill | batch | masks + accept, ms per step | apply (the engine's), ms | compile ms |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        docs_ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents(batch)]
        rounds: dict[int, list[dict]] = {i: [] for i in range(len(libs))}
        for _ in range(args.repeat):
            for i, lib in enumerate(libs):
                rounds[i].append(run_once(lib, docs_ids, vocab_size, batch))
        for i, lib in enumerate(libs):
            fill, apply, comp = (statistics.median(r[k] for r in rounds[i]) for k in ("fill_ms", "apply_ms",
                                                                                      "compile_ms"))
            how = "batched" if lib.batched else "row by row"
            print(f"| {lib.name} | {how} | {batch} | {fill:.2f} | {apply:.2f} | {comp:.0f} |", flush=True)
    # the no-grammar baseline: nothing to do; for scale, a float32 [batch, vocab] clone + argmax
    for batch in args.batch:
        logits = torch.randn(batch, vocab_size)
        t = []
        for _ in range(50):
            start = time.perf_counter()
            logits.clone().argmax(-1)
            t.append(time.perf_counter() - start)
        print(f"(for scale: clone + argmax of [{batch}, {vocab_size}] float32 logits: "
              f"{statistics.median(t) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
