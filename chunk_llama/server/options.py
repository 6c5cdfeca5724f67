"""`DeployArgs`: the server's guards, as flags of `chunk-llama serve` (and `CHUNK_LLAMA_<NAME>`
variables) and as the `create_app` argument `deploy`: who may call it (API keys), how much
one request may ask, how it sheds load (a bounded queue, deadlines), how long a slow client
may hold a connection, and how it stops (drain)."""

from __future__ import annotations

from dataclasses import dataclass

from chunk_llama.settings import UsageError, option


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
