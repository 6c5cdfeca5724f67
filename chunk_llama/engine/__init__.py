"""The serving engine: requests, scheduling, sampling and the step loop."""

from chunk_llama.engine.engine import ChunkLlamaEngine
from chunk_llama.engine.request import RequestOutput

__all__ = ["ChunkLlamaEngine", "RequestOutput"]
