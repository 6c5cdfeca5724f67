"""Fields other servers accept: unknown ones answered (logged once, listed in a response
header), malformed known ones still 400s, vLLM's sampling fields each doing what vLLM's
definition says (checked against `engine.generate`), `/tokenize`, `/detokenize` and
`max_model_len` in `/v1/models`, `/v1/models/{model}`, the bytes of logprobs' tokens
(over byte-level BPE and SentencePiece byte-fallback tokenizers). The tiny word-level Llama of test_server.py, through the
official `openai` client and httpx against a real server on 127.0.0.1."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from helpers import tiny_byte_llama, tiny_byte_tokenizer, tiny_sentencepiece_tokenizer
from test_server import MODEL, Server, chat, client, greedy, served, words  # noqa: F401 - fixtures
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.logs import forget_logged
from chunk_llama.server import create_app
from chunk_llama.server.fields import IGNORED_FIELDS_HEADER

EOS = 5  # the tiny tokenizer's EOS (w5), a special token; test_server's model never picks it by itself
UNKNOWN = {"functions": [], "guided_json": {"type": "object"}, "typical_p": 0.9, "mirostat": 2, "cache_prompt": True,
           "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low", "modalities": ["text"],
           "web_search_options": {}}


def test_ten_unknown_fields_are_answered_listed_and_logged_once(served, client, caplog):
    _, url = served
    forget_logged()
    messages = chat("w9", "w10")
    messages[1]["annotations"] = []  # a field unknown inside a message too
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, **UNKNOWN}
    with caplog.at_level(logging.WARNING, logger="chunk_llama.server"):
        for _ in range(2):
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
    listed = response.headers[IGNORED_FIELDS_HEADER].split(", ")
    assert sorted(listed) == sorted([*UNKNOWN, "messages[].annotations"])
    logged = [r.getMessage() for r in caplog.records if "unknown here" in r.getMessage()]
    assert len(logged) == 11 and all(any(repr(name) in m for m in logged) for name in UNKNOWN)
    # through the openai client's extra_body, as LangChain and LiteLLM send them
    sdk = client.chat.completions.with_raw_response.create(model=MODEL, messages=chat("w9", "w10"), max_tokens=2,
                                                           temperature=0, extra_body=UNKNOWN)
    assert sdk.parse().choices[0].finish_reason == "length" and "typical_p" in sdk.headers[IGNORED_FIELDS_HEADER]
    plain = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "w7", "max_tokens": 1}, timeout=30)
    assert IGNORED_FIELDS_HEADER.lower() not in plain.headers


@pytest.mark.parametrize("change, param", [
    ({"stop_token_ids": "w7"}, "stop_token_ids"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
    ({"skip_special_tokens": "maybe"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": [1]}, "include_stop_str_in_output"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"add_generation_prompt": 3}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
    ({"ignore_eos": "yes please"}, "ignore_eos"),
    ({"temperature": "hot"}, "temperature"),
])
def test_malformed_values_of_known_fields_are_400(served, change, param):
    _, url = served
    body = {"model": MODEL, "messages": chat("w9", "w10"), "max_tokens": 4, **change}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, (change, response.text)
    assert response.json()["error"]["param"] == param, response.json()


def test_stop_token_ids_and_include_stop_str_in_output(served, client):
    engine, _ = served
    messages = chat(words(40, 12), words(41, 3))
    (plain,) = greedy(engine, [messages], 12)
    stop_id = plain.token_ids[4]
    (expected,) = greedy(engine, [messages], 12, eos_token_id=[stop_id, EOS])
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              extra_body={"stop_token_ids": [stop_id]})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == expected.text  # the stop token's text stays
    assert response.usage.completion_tokens == plain.token_ids.index(stop_id) + 1
    stop = plain.text.split()[5]
    kept = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True})
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop])
    assert kept.choices[0].message.content == cut.choices[0].message.content + stop
    assert kept.choices[0].message.content.endswith(stop) and kept.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              stop=[stop], stream=True,
                                              extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == kept.choices[0].message.content


def test_min_tokens_ignore_eos_and_skip_special_tokens(served, client):
    """EOS pushed to the top by logit_bias: a request ends at once, unless min_tokens holds it
    back (transformers' min_new_tokens) or ignore_eos ignores it; the EOS that ends a text is
    never text, but EOS tokens generated under ignore_eos are, with skip_special_tokens false."""
    engine, _ = served
    prompt = "w7 w8 w9"
    bias = {"logit_bias": {str(EOS): 100}}

    def ask(**extra):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={**bias, **extra}).choices[0]

    first = ask()
    assert first.text == "" and first.finish_reason == "stop"
    held = ask(min_tokens=3)
    (expected,) = greedy(engine, [prompt], 6, min_new_tokens=3, sequence_bias=[[[EOS], 100.0]])
    assert held.text == expected.text and len(expected.token_ids) == 4 and held.finish_reason == "stop"
    assert EOS not in expected.token_ids[:3]
    ignored = ask(ignore_eos=True)
    assert ignored.finish_reason == "length" and ignored.text == ""  # six EOS tokens, special: no text
    kept = ask(ignore_eos=True, skip_special_tokens=False)
    assert kept.text.split() == ["w5"] * 6
    assert ask(skip_special_tokens=False).text == ""  # the EOS that ended it is not text


def test_add_generation_prompt_and_continue_final_message(served, client):
    engine, url = served
    messages = chat(words(42, 10), words(43, 2))
    open_prompt = {"messages": messages, "add_generation_prompt": False}
    (expected,) = greedy(engine, [open_prompt], 6)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"add_generation_prompt": False})
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(engine.tokenize(messages)) - 1  # without the final "w4"
    partial = [*messages, {"role": "assistant", "content": "w30 w31"}]
    continued = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    (expected,) = greedy(engine, [continued], 6)
    response = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=6, temperature=0,
                                              extra_body={"continue_final_message": True})
    assert response.choices[0].message.content == expected.text
    ids = engine.tokenize(continued)
    assert engine.tokenizer.decode(ids).endswith("w4 w30 w31") and response.usage.prompt_tokens == len(ids)
    both = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": partial, "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_tokenize_detokenize_and_max_model_len(served, client):
    engine, url = served
    messages = chat(words(44, 8), words(45, 2))
    ids = engine.tokenize(messages)
    counted = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()
    assert counted == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    text = httpx.post(url + "/tokenize", json={"prompt": "w7 w8", "return_token_strs": True}, timeout=30).json()
    assert text["tokens"] == [7, 8] and text["token_strs"] == ["w7", "w8"]
    assert httpx.post(url + "/detokenize", json={"tokens": [7, 8]}, timeout=30).json() == {"prompt": "w7 w8"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [7, 1000]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(url + "/tokenize", json={"model": MODEL}, timeout=30)
    assert neither.status_code == 400 and "either prompt or messages" in neither.json()["error"]["message"]
    wrong = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "w7"}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
    (listed,) = client.models.list().data
    assert listed.model_extra["max_model_len"] == engine.max_model_len == 2048
    # the count is what a request's prompt takes
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert response.usage.prompt_tokens == counted["count"]


def test_greedy_configs_unchanged_by_absent_extras(served, client):
    """Without any extra field a request's config is what it was: greedy tokens equal generate."""
    engine, _ = served
    messages = chat(words(46, 6), words(47, 2))
    (expected,) = engine.generate([messages], GenerationConfig(max_new_tokens=8, do_sample=False))
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == expected.text


def test_retrieve_each_listed_model_and_404_for_others(served, client):
    (listed,) = client.models.list().data
    assert client.models.retrieve(MODEL).model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    error = missing.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-4o'" in error["message"] and MODEL in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"seed": 18446744073709551615}, "seed"),
    ({"seed": -9223372036854775809}, "seed"),
    ({"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages.0.content"),
    ({"stop": ["ok", "\udc00"]}, "stop"),
])
def test_out_of_range_seed_and_lone_surrogates_are_400_naming_the_field(served, body, param):
    """At chat, and a lone surrogate also at the other routes (`json.dumps` escapes it: `\\ud83d`)."""
    _, url = served
    full = {"model": MODEL, "messages": chat("w9", "w10"), "max_tokens": 2, **body}
    response = httpx.post(url + "/v1/chat/completions", timeout=30, headers={"Content-Type": "application/json"},
                          content=json.dumps(full))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    message = response.json()["error"]["message"]
    if param == "seed":
        assert "-9223372036854775808 to 9223372036854775807" in message and "Overflow" not in message
    else:
        assert "contains a lone surrogate (\\u" in message and "TextEncodeInput" not in message
    if param != "messages.0.content":
        return
    for route, other, where in [("/v1/completions", {"prompt": "w7 \ud83d"}, "prompt"),
                                ("/v1/responses", {"input": "w7 \ud83d"}, "input.0.content"),
                                ("/tokenize", {"prompt": "w7 \ud83d"}, "prompt")]:
        text = json.dumps({"model": MODEL, "max_tokens": 2, **other})
        refused = httpx.post(url + route, content=text, headers={"Content-Type": "application/json"}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == where, (route, refused.text)
        assert "contains a lone surrogate (\\ud83d) at character 3" in refused.json()["error"]["message"]


def _expected_bytes(tokenizer, token: int) -> bytes:
    """A token's bytes read off its vocabulary entry: `<0xNN>` is that byte, "▁" a space, a
    byte-level BPE piece goes through GPT-2's byte table."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if piece.startswith("<0x") and len(piece) == 6:
        return bytes([int(piece[3:5], 16)])
    if "▁" in piece or all(ord(c) < 128 for c in piece):
        return piece.replace("▁", " ").encode()
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's table: the rest from U+0100 on
    table = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    return bytes(table[c] for c in piece)


@pytest.mark.parametrize("make_tokenizer", [tiny_byte_tokenizer, tiny_sentencepiece_tokenizer])
def test_logprobs_carry_each_tokens_bytes_also_inside_a_character(make_tokenizer):
    """A grammar makes the output "🎉你好" (in JSON quotes): every character over several byte
    tokens. Each token's `bytes` are its own, they join into the text, a token that is not
    whole UTF-8 reads `bytes:\\x..`, completions' alternatives keep one entry per token and
    `text_offset` counts characters."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = ChunkLlamaEngine(tiny_byte_llama(tokenizer), tokenizer, max_batch_size=2, kv_cache_bytes=4 << 20)
    schema = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["🎉你好"]}}}
    messages = [{"role": "user", "content": "party"}]
    expected, expected_legacy = engine.generate([messages, "party"], GenerationConfig(max_new_tokens=20,
                                                do_sample=False), grammar=schema)
    server = Server(create_app(engine, MODEL))
    try:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            logprobs=True, top_logprobs=3, response_format=schema)
        legacy = sdk.completions.create(model=MODEL, prompt="party", max_tokens=20, temperature=0, logprobs=3,
                                        extra_body={"response_format": schema})
    finally:
        server.stop()
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == expected.text and "🎉你好" in expected.text
    wanted = [_expected_bytes(tokenizer, t) for t in expected.token_ids]
    assert [bytes(c.bytes) for c in content] == wanted
    text_ids = [t for t in expected.token_ids if t not in tokenizer.all_special_ids]
    assert b"".join(_expected_bytes(tokenizer, t) for t in text_ids).decode() == expected.text
    partial = [c.token for c in content if c.token.startswith("bytes:")]
    assert "bytes:\\xf0" in partial and len(partial) >= 3
    for entry in [*content, *(t for c in content for t in c.top_logprobs)]:
        raw = bytes(entry.bytes)
        try:
            assert entry.token == raw.decode()
        except UnicodeDecodeError:
            assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    logprobs, text = legacy.choices[0].logprobs, legacy.choices[0].text
    assert "🎉你好" in text and all(len(top) == 3 for top in logprobs.top_logprobs)
    assert text == expected_legacy.text
    raw = [_expected_bytes(tokenizer, t) for t in expected_legacy.token_ids]
    assert logprobs.text_offset == [len(b"".join(raw[:i]).decode(errors="ignore")) for i in range(len(raw))]
    assert logprobs.text_offset[-1] <= len(text) and "\ufffd" not in "".join(logprobs.tokens)
