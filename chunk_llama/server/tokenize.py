"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: clients count a prompt's
tokens against the context (`max_model_len`) before they send it.

/tokenize takes a `prompt` (text, tokenized as /v1/completions tokenizes it, with the
tokenizer's special tokens unless `add_special_tokens` is false) or chat `messages` (with
`tools` and the chat template's options, rendered as /v1/chat/completions renders them) and
answers `{"count", "max_model_len", "tokens"}` (and `token_strs` with `return_token_strs`).
/detokenize takes `tokens` and answers `{"prompt"}`. The work runs in a worker thread under
the tokenizer's lock; the engine loop is not involved.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field, model_validator

from chunk_llama.server.chat import AppContext
from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.schemas import ChatMessage, Tool, _Strict
from chunk_llama.server.session import TemplateError
from chunk_llama.server.tools import chat_prompt


class TokenizeRequest(_Strict):
    """A text `prompt` or chat `messages` (one of them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def add_tokenize_routes(app, ctx: AppContext) -> None:
    """The two routes on `app`."""
    engine = ctx.engine

    def check(body) -> None:
        if engine.tokenizer is None:
            raise OpenAIError("this server has no tokenizer", status=404, type="not_found_error")
        if body.model is not None:
            ctx.models.adapter_for(body.model)  # a 400 unless served

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check(body)
        served = ctx.served

        def work():
            tokenizer = engine.tokenizer
            if body.messages is not None:
                options = dict(served.default_template_kwargs, **(body.chat_template_kwargs or {}))
                prompt = chat_prompt(body.messages, body.tools, served.tool_format, served.native_tools, {})
                messages, tools = (prompt["messages"], prompt["tools"]) if isinstance(prompt, dict) else (prompt, None)
                with engine.inputs.tokenizer_lock:
                    text = tokenizer.apply_chat_template(
                        messages, tools=tools, tokenize=False, continue_final_message=body.continue_final_message,
                        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                        **options)
                    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                with engine.inputs.tokenizer_lock:
                    ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            answer = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}
            if body.return_token_strs:
                with engine.inputs.tokenizer_lock:
                    answer["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
            return answer

        try:
            return await asyncio.to_thread(work)
        except (TemplateError, ValueError, TypeError) as error:  # a template that refuses these messages
            raise OpenAIError(f"the chat template cannot render these messages: {error}", param="messages") from error

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check(body)
        vocab = engine.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")

        def work():
            with engine.inputs.tokenizer_lock:
                return engine.tokenizer.decode(body.tokens)

        return {"prompt": await asyncio.to_thread(work)}
