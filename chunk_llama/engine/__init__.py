"""The serving engine: requests, scheduling, sampling and the step loop."""

from chunk_llama.engine.engine import ChunkLlamaEngine
from chunk_llama.engine.grammar import Grammar
from chunk_llama.engine.penalties import OpenAIPenaltiesLogitsProcessor
from chunk_llama.engine.request import RequestDelta, RequestOutput

__all__ = ["ChunkLlamaEngine", "Grammar", "OpenAIPenaltiesLogitsProcessor", "RequestDelta", "RequestOutput"]
