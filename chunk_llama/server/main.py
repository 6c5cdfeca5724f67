"""`serve`: load a model, build the engine and the app, run uvicorn."""

from __future__ import annotations

import os
import signal
import sys
import threading

from chunk_llama.settings import EngineArgs

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


def serve(engine_args: EngineArgs | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Load the model `engine_args` name (None: the default model, its defaults) and serve it
    on http://host:port until interrupted."""
    import uvicorn

    from chunk_llama.server.app import create_app

    engine_args = engine_args or EngineArgs()
    model = engine_args.model
    name = model_name_for(model)
    loaded, tokenizer = engine_args.load()
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        print(
            "warning: the tokenizer has no chat template: /v1/chat/completions will refuse requests",
            file=sys.stderr,
        )
    engine = engine_args.build_engine(loaded, tokenizer)
    aliases = (model,) if model is not None and model != name else ()
    app = create_app(engine, name, aliases=aliases, loop_thread=False)
    print(engine.describe(), file=sys.stderr)
    print(f"serving {name!r} on http://{host}:{port}/v1", file=sys.stderr)
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
