"""Reasoning output on a tiny Qwen3-family model with a chat template of Qwen3's conventions
(ChatML turns, `<think>` blocks, `enable_thinking`), trained here for a few hundred steps to
think before it answers: `reasoning_content` apart from `content` (whole and streamed), the
Responses API's reasoning items, and `enable_thinking: false` (per request, or as the
server's default) turning reasoning off. A real server on 127.0.0.1, the `openai` client."""

from __future__ import annotations

import copy
import threading

import openai
import pytest
import torch
from helpers import tiny_byte_tokenizer
from test_server import Server
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from chunk_llama import ChunkLlamaEngine
from chunk_llama.server import create_app
from chunk_llama.server.options import ChatArgs
from chunk_llama.server.reasoning import PromptProbe, reasoning_format

MODEL = "tiny-qwen3"
# Written here after Qwen3's documented behaviour: with enable_thinking false the generation
# prompt holds an empty think block, so the model answers at once.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "Weather?"}]
REASONING, ANSWER = "plan: look at the sky", "It is sunny."


def tiny_qwen3():
    """(model, tokenizer): a 2-layer Qwen3 over the byte-level tokenizer plus Qwen's ChatML and
    think tokens, trained to think then answer, and to answer at once after an empty think block."""
    tokenizer = tiny_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<think>", "</think>"])  # not special, as in Qwen3's tokenizer
    tokenizer.chat_template = TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         eos_token_id=end, bos_token_id=end, pad_token_id=0, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = end
    examples = []
    for kwargs, target in (({}, f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"), ({"enable_thinking": False}, ANSWER)):
        text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, **kwargs)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        examples.append((prompt, tokenizer(target, add_special_tokens=False)["input_ids"] + [end]))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        loss = 0.0
        for prompt, target in examples:
            ids = torch.tensor([prompt + target])
            logits = model(ids).logits[0, len(prompt) - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def trained():
    return tiny_qwen3()


def start(model, tokenizer, chat=None):
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, chunk_size=16, kv_cache_bytes=4 << 20)
    return engine, Server(create_app(engine, MODEL, chat=chat))


@pytest.fixture(scope="module")
def served(trained):
    model, tokenizer = trained
    engine, server = start(copy.deepcopy(model), tokenizer)
    try:
        yield engine, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        server.stop()


def test_the_model_thinks_then_answers(served):
    engine, _ = served
    (out,) = engine.generate([QUESTION], GenerationConfig(max_new_tokens=40, do_sample=False))
    assert out.text == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"


def test_reasoning_content_whole_and_streamed(served):
    _, client = served
    message = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                             temperature=0).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                                stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        assert "<think>" not in (delta.content or "") and "</think>" not in (delta.content or "")
    assert (reasoning, content) == (REASONING, ANSWER)
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0)
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "length"
    assert REASONING.startswith(cut.choices[0].message.reasoning_content)  # cut inside: all reasoning, no answer
    raw = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                         extra_body={"separate_reasoning": False}).choices[0].message
    assert raw.content == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"


def test_enable_thinking_false_turns_reasoning_off(served):
    _, client = served
    message = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                                             ).choices[0].message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None
    response = client.responses.create(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=40,
                                       temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [i.type for i in response.output] == ["message"] and response.output_text == ANSWER


def test_responses_reasoning_items(served):
    _, client = served
    response = client.responses.create(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=40, temperature=0)
    assert [i.type for i in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == REASONING and response.output_text == ANSWER
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with client.responses.stream(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=40,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert final.output_text == ANSWER and final.usage.output_tokens_details.reasoning_tokens == \
        response.usage.output_tokens_details.reasoning_tokens


def test_server_default_template_kwargs_and_concurrent_requests(trained):
    """`--default-chat-template-kwargs '{"enable_thinking": false}'`: no reasoning unless a request
    asks for it; 4 concurrent requests of each kind, each split as its own template says."""
    model, tokenizer = trained
    engine, server = start(copy.deepcopy(model), tokenizer,
                           ChatArgs(default_chat_template_kwargs='{"enable_thinking": false}'))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        results, errors = {}, []

        def run(key, kwargs):
            try:
                results[key] = client.chat.completions.create(
                    model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                    extra_body={"chat_template_kwargs": kwargs} if kwargs else None).choices[0].message
            except Exception as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=run, args=((k, i), {"enable_thinking": True} if k else None))
                   for k in (0, 1) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(results) == 8
        for (thinking, _), message in results.items():
            expected = (REASONING, ANSWER) if thinking else (None, ANSWER)
            assert (getattr(message, "reasoning_content", None), message.content) == expected
    finally:
        server.stop()


def test_where_the_template_leaves_the_reasoning(trained):
    _, tokenizer = trained
    fmt = reasoning_format("auto", tokenizer)
    assert fmt.name == "qwen3" and not fmt.special
    lock = threading.Lock()
    assert PromptProbe(tokenizer, lock, fmt).opened({}) is False  # the model opens it itself
    assert PromptProbe(tokenizer, lock, fmt).opened({"enable_thinking": False}) is None  # closed by the prompt
    opening = copy.copy(tokenizer)
    opening.chat_template = TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
    assert PromptProbe(opening, lock, fmt).opened({}) is True  # DeepSeek-R1's way: the output starts inside
    assert reasoning_format("none", tokenizer) is None
