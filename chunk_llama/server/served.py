"""What the served model and its chat template imply for every request, found once when the
app is built: the vocabulary, the end-of-sequence ids and the context; the tool-call
format and whether the template renders tools itself (`tool_formats.py`); the reasoning
format and where the template leaves the reasoning (`reasoning.py`); and the server's
default `chat_template_kwargs`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from chunk_llama.server.reasoning import PromptProbe, ReasoningFormat, reasoning_format
from chunk_llama.server.tool_formats import ToolFormat, template_renders_tools, tool_format

logger = logging.getLogger("chunk_llama.server")


@dataclass
class ServedModel:
    """See the module doc; `reasoning_opened(kwargs)` says where a prompt rendered with those
    template kwargs leaves the reasoning (`reasoning.PromptProbe.opened`)."""

    vocab_size: int
    eos_ids: list[int]
    max_positions: int | None
    tool_format: ToolFormat
    native_tools: bool
    reasoning: ReasoningFormat | None = None
    probe: PromptProbe | None = None
    default_template_kwargs: dict = field(default_factory=dict)

    def reasoning_opened(self, template_kwargs: dict) -> bool | None:
        return self.probe.opened(template_kwargs) if self.probe is not None else False

    def describe(self) -> str:
        """One line for the log: the formats in use."""
        where = "rendered by the chat template" if self.native_tools else "described in the system prompt"
        reasoning = self.reasoning.name if self.reasoning is not None else "none"
        return f"tool calls: {self.tool_format.name} ({where}); reasoning parser: {reasoning}"


def served_model(engine, reasoning_parser: str | None = "auto", tool_call_parser: str | None = "auto",
                 default_template_kwargs: dict | None = None) -> ServedModel:
    """The `ServedModel` of `engine`'s model and tokenizer under the `--reasoning-parser` and
    `--tool-call-parser` choices (raises `UsageError` for an unknown name)."""
    tokenizer = engine.tokenizer
    eos = getattr(engine.model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tools = tool_format(tool_call_parser, tokenizer)
    native = tokenizer is not None and template_renders_tools(tokenizer)
    reasoning = reasoning_format(reasoning_parser, tokenizer) if tokenizer is not None else None
    probe = PromptProbe(tokenizer, engine.inputs.tokenizer_lock, reasoning) if reasoning is not None else None
    served = ServedModel(engine.model.config.vocab_size, eos_ids, engine.max_model_len, tools, native, reasoning,
                         probe, dict(default_template_kwargs or {}))
    logger.info(served.describe())
    return served
