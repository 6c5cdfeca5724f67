"""An OpenAI-compatible HTTP server over `ChunkLlamaEngine` (`chunk-llama serve`).

`create_app(engine, model_name)` builds the FastAPI app; `serve(...)` loads a model
and runs it under uvicorn. One engine loop thread steps the engine (`loop.py`);
the handlers only queue requests and relay their deltas.
"""

from chunk_llama.server.app import create_app
from chunk_llama.server.main import model_name_for, serve

__all__ = ["create_app", "model_name_for", "serve"]
