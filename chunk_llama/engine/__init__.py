"""The serving engine: requests, scheduling, sampling and the step loop."""

from chunk_llama.engine.engine import ChunkLlamaEngine
from chunk_llama.engine.request import RequestDelta, RequestOutput

__all__ = ["ChunkLlamaEngine", "RequestDelta", "RequestOutput"]
