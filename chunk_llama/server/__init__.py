"""An OpenAI-compatible HTTP server over `ChunkLlamaEngine` (`chunk-llama serve`).

`create_app(engine, model_name)` builds the FastAPI app; `serve(...)` loads a model
and runs it under uvicorn. One engine loop thread steps the engine (`loop.py`);
the handlers only queue requests and relay their deltas.
"""

__all__ = ["create_app", "model_name_for", "serve"]


def __getattr__(name: str):
    # Imported on first use: `chunk_llama.server.options` (the serve flags, which every
    # command's parser reads) must import without the [serve] extra (fastapi, uvicorn).
    if name == "create_app":
        from chunk_llama.server.app import create_app

        return create_app
    if name in ("model_name_for", "serve"):
        from chunk_llama.server import main

        return getattr(main, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
