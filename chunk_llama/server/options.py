"""The flags of `chunk-llama serve` beyond the engine's (and `CHUNK_LLAMA_<NAME>` variables):
`ServeArgs`, where to listen, under which names and how to log; `DeployArgs`, the
server's guards, also the `create_app` argument `deploy`: who may call it (API keys), how
much one request may ask, how it sheds load (a bounded queue, deadlines), how long a slow
client may hold a connection, and how it stops (drain); `ChatArgs`, how chat text is read
and written: the reasoning and tool-call formats, the chat template's default variables, the
Responses API's store.

The parser names are those of `reasoning.py` and `tool_formats.py` (a test checks they agree;
they are repeated here so that reading the flags imports no model code)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from chunk_llama.errors import UsageError
from chunk_llama.settings import option


@dataclass
class DeployArgs:
    """Who may call the server, how much one request may ask, and how it sheds load and stops."""

    api_key: list[str] | None = option(None, "a key clients must send as 'Authorization: Bearer KEY' on /v1/* "
                                             "(repeat the flag for several; the variable takes them "
                                             "comma-separated)", action="append", nargs=None, metavar="KEY",
                                       secret=True)
    api_key_file: str | None = option(None, "a file of API keys, one a line ('#' starts a comment)")
    metrics_need_key: bool = option(False, "/metrics needs an API key too (default: open, like /health)")
    max_request_bytes: int = option(8 << 20, "largest request body in bytes (413 beyond)")
    max_messages: int = option(1024, "most messages in one chat request")
    max_prompts: int = option(64, "most prompts in one /v1/completions request")
    max_waiting_requests: int = option(256, "most requests queued for the batch; beyond, 429 with Retry-After")
    request_timeout: float | None = option(None, "seconds a request may run from its arrival before it ends "
                                                 "with what it generated (finish_reason 'length'; default: no "
                                                 "limit); the openai client's timeout shortens it for a "
                                                 "non-streaming request")
    header_timeout: float = option(10.0, "seconds a client has to send a request's head and body once it starts "
                                         "(or once its connection opens); then the connection is closed")
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive connection stays open")
    drain_timeout: float = option(30.0, "on SIGTERM or SIGINT: seconds the running requests may take to finish "
                                        "(new ones get 503) before the rest are aborted and the server exits; "
                                        "a second SIGINT exits at once")

    def __post_init__(self):
        for name in ("max_request_bytes", "max_messages", "max_prompts", "max_waiting_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{name} must be a positive int, got {value!r}")
        for name in ("request_timeout", "header_timeout", "keep_alive_timeout", "drain_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UsageError(f"{name} must be a positive number of seconds, got {value!r}")

    def keys(self) -> list[str]:
        """The API keys of `api_key` and `api_key_file` (empty: no authentication)."""
        from chunk_llama.server.auth import read_key_file

        keys = [k.strip() for k in self.api_key or [] if k.strip()]
        if self.api_key_file:
            keys += read_key_file(self.api_key_file)
        return list(dict.fromkeys(keys))


@dataclass
class ServeArgs:
    """Where to listen, under which names, and how to log."""

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to bind")
    served_model_name: list[str] | None = option(None, "the names requests may give as `model` (the first is "
                                                       "the one /v1/models lists; default: from --model)")
    log_level: str = option("info", "logging level of the server, the engine and libraries",
                            choices=("debug", "info", "warning", "error", "critical"))
    allowed_origins: list[str] | None = option(None, "browser origins allowed by CORS ('*': any; default: none)")
    stats_interval: float = option(10.0, "seconds between stats lines while busy (0: none)")
    data_parallel: int = option(1, "engine workers on this machine, behind sglang-router's cache-aware routing, "
                                   "one router per model (N > 1; each worker its own GPU, or its share of the CPU "
                                   "cores)")
    worker_urls: list[str] | None = option(None, "`chunk-llama serve` workers on other machines the router also "
                                                 "routes to (with --data-parallel: besides the local ones; 0 local)")
    router_policy: str = option("cache_aware", "sglang-router's policy",
                                choices=("cache_aware", "round_robin", "random", "power_of_two"))
    router_metrics_port: int = option(0, "port of the routers' Prometheus metrics, one page labelled router_model "
                                         "(0: a free one)")
    worker_start_timeout: float = option(300.0, "seconds a worker may take to load and answer /health")
    worker_id: str | None = option(None, "this server's name behind a router (the launcher sets it): in the "
                                         "X-Chunk-Llama-Worker header and every metric's worker label")


REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "glm45", "mistral")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


@dataclass
class ChatArgs:
    """How chat text is read and written: reasoning and tool-call formats, template defaults."""

    reasoning_parser: str = option("auto", "where a thinking model's reasoning is, apart from its answer "
                                           "(reasoning_content; Responses reasoning items): auto finds the tags "
                                           "in the chat template, none leaves them in the content",
                                   choices=REASONING_PARSERS)
    tool_call_parser: str = option("auto", "the model's tool-call format (parsed from its output, and written "
                                           "by forced calls); auto: the one the chat template writes, else hermes",
                                   choices=TOOL_CALL_PARSERS)
    default_chat_template_kwargs: str | None = option(None, "a JSON object of chat template variables for "
                                                            "every request (e.g. '{\"enable_thinking\": false}'); "
                                                            "a request's chat_template_kwargs override them")
    max_stored_responses: int = option(1024, "most Responses API responses kept for previous_response_id "
                                             "(in memory; the least recently used go first)")

    def __post_init__(self):
        self.template_kwargs()
        if not isinstance(self.max_stored_responses, int) or self.max_stored_responses < 0:
            raise UsageError(f"max_stored_responses must be an int >= 0, got {self.max_stored_responses!r}")

    def template_kwargs(self) -> dict:
        """`default_chat_template_kwargs` as a dict (raises `UsageError` unless a JSON object)."""
        if not self.default_chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.default_chat_template_kwargs)
        except json.JSONDecodeError as error:
            raise UsageError(f"--default-chat-template-kwargs is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise UsageError("--default-chat-template-kwargs must be a JSON object")
        return value
