"""Grammar-constrained decoding (structured output, forced tool calls) with llguidance.

A request may carry a `Grammar`: a JSON schema, "any JSON object" or a Lark grammar
(llguidance's dialect, which can embed JSON schemas with `%json {...}`). Each of its
samples gets a `GrammarState`: an llguidance matcher and the packed bitmask of the
tokens allowed next (`[ceil(vocab / 32)]` int32, bit j of word i = token 32 i + j).

The mask for the next step is computed off the engine's thread: when a token is
accepted (`advance`, called as the token is appended to the sample) the matcher
consumes it and computes the next mask in a worker thread (llguidance drops the GIL
while it does), so the work overlaps the next forward pass; the sampling step only
waits for it and adds `log(bit)` (0 or -inf) to the row (`constrain`). Requests
without a grammar take none of this.

Why llguidance (docs/ARCHITECTURE.md, "Structured output"): it has no dependencies
(xgrammar brings triton, about 1 GB), compiles a schema in about 1 ms (outlines-core: 100 ms,
and regular expressions only) and takes Lark grammars with JSON schemas inside, which the
tool-call blocks and the eval's action format need. Its masks cost the most of the three
per step (scripts/bench_grammar.py, batch 16 on the default model's 49,152-token vocabulary:
0.57 ms against xgrammar's 0.13 and outlines-core's 0.10), about 0.5% of a decode step of
that batch, computed while the forward runs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Compact JSON ("," and ":" with no whitespace): the model cannot pad its output with
# whitespace forever, which a small model under a flexible grammar does.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. Build one with `json_schema`, `json_object`,
    `lark` or `from_response_format` (OpenAI's `response_format`)."""

    kind: str  # "json_schema" | "lark"
    source: str  # the schema as JSON text, or the Lark grammar

    @classmethod
    def json_schema(cls, schema: dict) -> Grammar:
        """Output a JSON value valid under `schema` (a dict)."""
        if not isinstance(schema, dict):
            raise TypeError(f"a JSON schema must be a dict, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        """Output any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Output matching a Lark grammar in llguidance's dialect (its `start` rule)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise TypeError("a Lark grammar must be a non-empty string")
        return cls("lark", grammar)

    @classmethod
    def from_response_format(cls, response_format: dict) -> Grammar | None:
        """OpenAI's `response_format`: `{"type": "text"}` (None: no constraint),
        `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema",
        "strict"}}` (the schema is enforced whether or not `strict` is set)."""
        if not isinstance(response_format, dict):
            raise TypeError(f"response_format must be a dict, got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return cls.json_schema(spec.get("schema", {}))
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's input form."""
        import llguidance

        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


def as_grammar(value) -> Grammar | None:
    """A request's `grammar` argument: a `Grammar`, OpenAI's `response_format` dict, or None."""
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, dict):
        return Grammar.from_response_format(value)
    raise TypeError(f"grammar must be a Grammar or a response_format dict, got {type(value).__name__}")


class GrammarCompiler:
    """Per engine: the tokenizer as llguidance sees it (built on first use), the worker
    thread that computes masks, and the compiled grammars of recent requests (a fresh
    matcher is a copy of the compiled one: compiling the eval's grammar takes 0.36 s, a
    copy microseconds)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], max_cached: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._llg_tokenizer = None
        self._llg_refused: str | None = None  # why llguidance cannot read the tokenizer (once found)
        self._worker: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()

    def prepare(self):
        """Build llguidance's view of the tokenizer now (about 0.3 s for a 49,152-token vocabulary;
        otherwise the first request with a grammar waits for it); returns it."""
        with self._lock:
            if self._llg_tokenizer is None:
                if self.tokenizer is None:
                    raise ValueError("a grammar needs a tokenizer; pass one to ChunkLlamaEngine")
                if self._llg_refused is not None:  # (reading it again would fail again, as slowly)
                    raise ValueError(self._llg_refused)
                import llguidance.hf

                try:
                    self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, self.vocab_size,
                                                                      eos_token=self.eos_token_ids or None)
                except ValueError as error:
                    self._llg_refused = f"grammars need a tokenizer llguidance can read: {error}"
                    raise ValueError(self._llg_refused) from error
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="chunk-llama-grammar")
            return self._llg_tokenizer

    def start(self, grammar: Grammar) -> GrammarState:
        """A fresh state for one sample; its first mask is being computed when this returns.
        Raises ValueError naming the problem for a grammar llguidance refuses."""
        import llguidance

        tokenizer = self.prepare()
        with self._lock:
            compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(tokenizer, grammar.llguidance_grammar(), log_level=0)
            if compiled.is_error():
                raise ValueError(f"invalid {grammar.kind.replace('_', ' ')} grammar: {compiled.get_error()}")
        with self._lock:
            self._compiled[grammar] = compiled
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
            matcher = compiled.deep_copy()
        return GrammarState(matcher, self.vocab_size, self._worker)


class GrammarState:
    """One sample's matcher and its next mask (see module doc). Only the worker thread
    touches the matcher while a mask is being computed."""

    def __init__(self, matcher, vocab_size: int, worker: ThreadPoolExecutor):
        self.matcher = matcher
        self.worker = worker
        self.bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self.warned = False
        self.pending: Future = worker.submit(self._fill)

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)

    def _consume_and_fill(self, token: int, fill: bool) -> None:
        if not self.matcher.consume_token(token) and not self.warned:
            self.warned = True  # a processor allowed a token the grammar had masked
            logger.warning("a constrained sample took token %d, which its grammar does not allow (%s); "
                           "from here on it may only end", token, self.matcher.get_error())
        if fill:
            self._fill()

    def advance(self, token: int, more: bool) -> None:
        """The sample took `token`; compute the next mask in the background if `more` tokens follow."""
        self.pending.result()
        self.pending = self.worker.submit(self._consume_and_fill, token, more)

    def constrain(self, row: torch.Tensor) -> None:
        """Set the disallowed tokens of `row` ([1, vocab] float32, modified in place) to -inf."""
        self.pending.result()
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, count=row.shape[1], bitorder="little")
        with np.errstate(divide="ignore"):  # log(0) = -inf is the point: adding is 5x faster than masked_fill
            penalty = np.log(bits, dtype=np.float32)
        if row.device.type == "cpu":  # in numpy, one thread: a 2-thread torch op of this size waits on the other core
            np.add(row.numpy(), penalty, out=row.numpy())
        else:
            row.add_(torch.from_numpy(penalty).to(row.device))
