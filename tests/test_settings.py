"""Kernel settings read from the environment: once per model forward (`frozen_settings`),
at every call outside one."""

import threading

from chunk_llama.ops import isa
from chunk_llama.ops.jit import force_reference, frozen_settings, setting


def test_a_forward_reads_each_setting_once_and_the_next_one_sees_a_change(monkeypatch):
    monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "0")
    with frozen_settings():
        assert not force_reference()
        monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "1")
        assert not force_reference()  # the block's value
        with frozen_settings():  # nested (a forward inside a forward): the outer block's values
            assert not force_reference()
        seen_elsewhere = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(force_reference()))
        thread.start()
        thread.join()
        assert seen_elsewhere == [True]  # another thread is not inside this block
    assert force_reference()  # outside any block: read at once
    with frozen_settings():
        assert force_reference()


def test_settings_keep_their_defaults_and_the_variant_follows(monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    with frozen_settings():
        assert setting("CHUNK_LLAMA_NOT_SET", "fallback") == "fallback"
        assert setting("CHUNK_LLAMA_NOT_SET") == ""
        assert isa.selected_variant() == isa.host_variants()[0]
    monkeypatch.setenv(isa.ENV, "generic")
    assert isa.selected_variant() == "generic"
