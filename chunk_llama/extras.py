"""The optional parts of chunk-llama and the pip extras that install them.

`pip install chunk-llama` gives the engine and `generate`; `[serve]`, `[router]`, `[eval]`
and `[gguf]` add the server, replicas behind sglang-router, the evaluation and `.gguf`
models (`[all]`: every one). A command or loader that needs an extra calls `require`
before its imports, so a missing one is one line naming the extra to install, not a
traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util

# extra: the modules it provides that chunk-llama imports (pyproject.toml's lists install them)
EXTRAS = {
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "router": ("sglang_router",),
    "eval": ("datasets", "accelerate"),
    "gguf": ("gguf", "accelerate"),  # transformers loads a GGUF file only with accelerate
}


class MissingExtraError(ImportError):
    """A feature's extra is not installed; the message says which and how to install it."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, feature: str) -> None:
    """MissingExtraError unless every module of `extra` is installed; `feature` names what
    needs it (e.g. "chunk-llama serve")."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(f"{feature} needs the [{extra}] extra, which is not installed (no "
                                f"{', '.join(absent)}): pip install 'chunk-llama[{extra}]'")
