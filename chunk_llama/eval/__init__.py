"""Offline evaluation of prompt sets whose requests share long system prompts.

Exports are imported on first use, so the command line starts without loading
`datasets` for commands that do not need it.
"""

_EXPORTS = {
    "REQUIRED_COLUMNS": "chunk_llama.eval.data",
    "load_prompt_set": "chunk_llama.eval.data",
    "EvalConfig": "chunk_llama.eval.runner",
    "run_eval": "chunk_llama.eval.runner",
    "extract_tool_call": "chunk_llama.eval.scoring",
    "is_correct": "chunk_llama.eval.scoring",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'chunk_llama.eval' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
