"""The private transformers APIs chunk-llama uses (chunk_llama/hf/private_api.py) are as the
code expects in the installed release, and a changed one is reported by name."""

from __future__ import annotations

import transformers

from chunk_llama.hf import private_api
from chunk_llama.hf.private_api import PrivateApi


def test_installed_transformers_has_every_private_api_as_used():
    assert private_api.check() == []


def test_a_changed_api_is_named_with_the_code_that_uses_it(monkeypatch):
    gone = PrivateApi("transformers.generation.utils:GenerationMixin._no_such_method", "engine/x.py", ("a",))
    renamed_parameter = PrivateApi("transformers.generation.utils:GenerationMixin._validate_generated_length",
                                   "engine/y.py", ("generation_config", "prompt_length"))
    not_a_property = PrivateApi("transformers.cache_utils:Cache.get_seq_length", "hf/z.py", kind="property")
    monkeypatch.setattr(private_api, "PRIVATE_APIS", (gone, renamed_parameter, not_a_property))
    version = transformers.__version__
    assert private_api.check() == [
        f"transformers {version}: {gone.path} does not exist; used in chunk_llama/engine/x.py",
        f"transformers {version}: {renamed_parameter.path} no longer takes prompt_length; used in "
        "chunk_llama/engine/y.py",
        f"transformers {version}: {not_a_property.path} is no longer a property (a function); used in "
        "chunk_llama/hf/z.py",
    ]


def test_the_listed_engine_functions_are_the_ones_the_code_calls():
    """Every `model._name(` in hf/generation.py is listed (a new use must be added)."""
    import re
    from pathlib import Path

    source = (Path(private_api.__file__).parent / "generation.py").read_text()
    called = set(re.findall(r"model\.(_\w+)\(", source))
    listed = {api.path.rsplit(".", 1)[1] for api in private_api.PRIVATE_APIS}
    assert called and called <= listed, called - listed
