"""LoRA adapters over HTTP (`server/adapters.py`), through a real uvicorn server behind an API
key: a request's `model` selects an adapter or the base, /v1/models lists the adapters with
their parent, adapters load and unload while the server runs, and every refusal is a 4xx
naming the problem. And `--lora-modules` as every command (and each `--data-parallel`
worker) reads it."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
import torch
from helpers import tiny_llama, tiny_tokenizer
from lora_adapters import SPECS, make_adapter
from test_server import CHAT_TEMPLATE, Server
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.errors import UsageError
from chunk_llama.server import create_app
from chunk_llama.server.options import DeployArgs
from chunk_llama.settings import EngineArgs, add_arguments, from_namespace, lora_modules, to_argv

pytest.importorskip("peft")
MODEL = "tiny-llama"
KEY = "sk-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, url, adapter folders): "a" loaded at start; "b" (rank 4), "wide" (rank 32) and
    "other" (another base's) to load."""
    model = tiny_llama(max_position_embeddings=2048)
    with torch.no_grad():
        model.lm_head.weight[5].zero_()  # (no EOS: every answer runs to max_tokens)
    root = tmp_path_factory.mktemp("served-adapters")
    folders = {"a": make_adapter(model, str(root / "a"), seed=1, scale=3.0, **SPECS["b"]),
               "b": make_adapter(model, str(root / "b"), seed=2, scale=3.0, **SPECS["a"]),
               "wide": make_adapter(model, str(root / "wide"), seed=3, **SPECS["c"]),
               "other": make_adapter(tiny_llama(head_dim=32), str(root / "other"), seed=4, **SPECS["a"])}
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=8, chunk_size=16, kv_cache_bytes=8 << 20,
                              lora_modules={"a": folders["a"]}, max_lora_rank=16)
    server = Server(create_app(engine, MODEL, deploy=DeployArgs(api_key=[KEY])))
    try:
        yield engine, server.url, folders
    finally:
        server.stop()


def post(url: str, path: str, body: dict, headers=HEADERS) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def greedy(engine, prompt: str, adapter=None) -> str:
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    return engine.generate([prompt], config, adapter=adapter)[0].text


def test_a_requests_model_selects_an_adapter_or_the_base(served):
    engine, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    listed = client.models.list().data
    assert [(m.id, m.parent) for m in listed] == [(MODEL, None), ("a", MODEL)]
    prompt = "w7 w8 w9 w10 w11 w12"
    texts = {model: client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
             for model in (MODEL, "a")}
    assert texts == {MODEL: greedy(engine, prompt), "a": greedy(engine, prompt, "a")}
    assert texts[MODEL] != texts["a"]
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "w20 w21"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "a" and chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="model 'b' does not exist here; this server serves "
                                                     "'tiny-llama' and the adapters 'a'"):
        client.completions.create(model="b", prompt=prompt, max_tokens=2)


def test_adapters_load_and_unload_behind_the_key_and_refusals_name_the_problem(served):
    engine, url, folders = served
    load = {"lora_name": "b", "lora_path": folders["b"]}
    assert post(url, "/v1/load_lora_adapter", load, headers={}).status_code == 401
    loaded = post(url, "/v1/load_lora_adapter", load)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'b' added successfully."
    prompt = "w30 w31 w32"
    answer = post(url, "/v1/completions", {"model": "b", "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == greedy(engine, prompt, "b")
    refusals = [
        ({"lora_name": "b", "lora_path": folders["a"]}, "the adapter 'b' has already been loaded"),
        ({"lora_name": MODEL, "lora_path": folders["a"]}, "the base model's name"),
        ({"lora_name": "wide", "lora_path": folders["wide"]}, "has rank 32, over the limit of 16"),
        ({"lora_name": "other", "lora_path": folders["other"]}, "is for another base model"),
        ({"lora_name": "gone", "lora_path": folders["b"] + "-missing"}, "has no adapter_config.json"),
        ({"lora_name": "c"}, "lora_path: Field required"),
    ]
    for body, message in refusals:
        refused = post(url, "/v1/load_lora_adapter", body)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"], (body, refused.text)
    replaced = post(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": folders["a"], "load_inplace": True})
    assert replaced.status_code == 200 and greedy(engine, prompt, "b") == greedy(engine, prompt, "a")
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}, headers={}).status_code == 401
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    gone = post(url, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "the adapter 'b' cannot be found"
    assert post(url, "/v1/completions", {"model": "b", "prompt": prompt, "max_tokens": 2}).status_code == 400
    assert [m["id"] for m in httpx.get(url + "/v1/models", headers=HEADERS, timeout=10).json()["data"]] == [MODEL, "a"]


def test_lora_modules_as_every_command_and_each_worker_reads_them(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineArgs)
    args = from_namespace(EngineArgs, parser.parse_args(
        ["--lora-modules", "a=/x/a", "b=/y/b", "--max-loras", "2", "--max-lora-rank", "64"]))
    assert lora_modules(args.lora_modules) == {"a": "/x/a", "b": "/y/b"}
    kwargs = args.engine_kwargs()
    assert (kwargs["lora_modules"], kwargs["max_loras"], kwargs["max_lora_rank"]) == ({"a": "/x/a", "b": "/y/b"}, 2, 64)
    # a --data-parallel worker's command line gives the same adapters again
    again = from_namespace(EngineArgs, parser.parse_args(to_argv(args)))
    assert again.engine_kwargs() == kwargs
    for bad, message in ((["a"], "give each adapter as NAME=PATH"), (["a=/x", "a=/y"], "'a' is given twice")):
        with pytest.raises(UsageError, match=message):
            lora_modules(bad)
