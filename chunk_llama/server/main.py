"""`serve`: load a model, build the engine and the app, run uvicorn."""

from __future__ import annotations

import os
import signal
import sys
import threading

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def model_name_for(path: str | None) -> str:
    """The id the server answers to: the model file's or folder's name (a hub id as given),
    or the default model's name."""
    if path is None:
        return DEFAULT_MODEL_NAME
    if os.path.exists(path):
        name = os.path.basename(os.path.normpath(path))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name
    return path


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch_size: int = 32,
    kv_cache_bytes: int | None = None,
    dtype: str = "float32",
    chunk_size: int | None = None,
    log_level: str = "info",
) -> None:
    """Load `model` (a .gguf file, a folder or a hub id; None: the default model) and serve
    it on http://host:port until interrupted."""
    import torch
    import uvicorn

    from chunk_llama import ChunkLlamaEngine, load_model
    from chunk_llama.server.app import create_app

    name = model_name_for(model)
    print(f"loading {model or 'the default model (' + DEFAULT_MODEL_NAME + ')'} ...", file=sys.stderr)
    loaded, tokenizer = load_model(model, dtype=getattr(torch, dtype))
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        print(
            "warning: the tokenizer has no chat template: /v1/chat/completions will refuse requests",
            file=sys.stderr,
        )
    engine = ChunkLlamaEngine(
        loaded, tokenizer, max_batch_size=max_batch_size, chunk_size=chunk_size, kv_cache_bytes=kv_cache_bytes
    )
    aliases = (model,) if model is not None and model != name else ()
    app = create_app(engine, name, aliases=aliases, loop_thread=False)
    print(
        f"serving {name!r} on http://{host}:{port}/v1 (attention: {engine.stats['attention_backend']}, "
        f"linear layers: {engine.stats['linear_backend']})",
        file=sys.stderr,
    )
    # The engine steps in this thread, which made the model's OpenMP teams (see
    # server/loop.py); uvicorn serves from another and ends the loop when it stops.
    loop = app.state.loop
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))

    def serve_http():
        try:
            server.run()
        finally:
            loop.stop()

    http = threading.Thread(target=serve_http, name="chunk-llama-http")
    http.start()
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))  # both end it gracefully
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        loop.stop()
        http.join(30)
    if not server.started:
        raise SystemExit(f"the HTTP server did not start on {host}:{port} (see its log above)")
