"""Fields other servers accept: unknown ones answered (logged once, listed in a response
header), malformed known ones still 400s, vLLM's sampling fields each doing what vLLM's
definition says (checked against `engine.generate`), `/tokenize`, `/detokenize` and
`max_model_len` in `/v1/models`. The tiny word-level Llama of test_server.py, through the
official `openai` client and httpx against a real server on 127.0.0.1."""

from __future__ import annotations

import logging

import httpx
import pytest
from test_server import MODEL, chat, client, greedy, served, words  # noqa: F401 - fixtures
from transformers import GenerationConfig

from chunk_llama.logs import forget_logged
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
