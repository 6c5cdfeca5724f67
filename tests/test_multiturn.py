"""Multi-turn reuse: a conversation's next turn finds the earlier turns' chunks, its prompt
built from the ids the engine used and generated (engine/conversation.py)."""

import logging

import pytest
from helpers import stock_greedy, tiny_bpe_tokenizer, tiny_llama
from transformers import GenerationConfig

from chunk_llama.engine import ChunkLlamaEngine

CHUNK = 16
# ChatML-like: each message is <bos>role content<eos>; the generation prompt opens an assistant turn (only
# characters of the tokenizer's small training corpus: it has no others)
CHAT = ("{% for m in messages %}<bos>{{ m['role'] }} {{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant {% endif %}")
# a header with one word per message: no turn's rendering is a prefix of the next one's
COUNTED = "{% for m in messages %}go {% endfor %}" + CHAT
SYSTEM = "tool call: weather(city) observation: sunny " * 12 + "the quick brown fox jumps over the lazy dog"
NOT_IN_REPLIES = [0, 1]  # <pad>, <bos>: a reply's text would not show them (a random model writes anything)
USERS = ["abcdef ghijkl", "observation: sunny then go", "stop here then go", "observation: lazy dog"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(eos=2, max_position_embeddings=1024)


def chat_tokenizer(template):
    tokenizer = tiny_bpe_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def all_but_single_characters(tokenizer, chars="he") -> list[int]:
    """Ids of every token but the single characters `chars`: a reply written with these
    alone has pairs "he" that the tokenizer re-tokenizes with its merges (other ids)."""
    keep = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c))[0] for c in chars}
    return [i for i in range(len(tokenizer)) if i not in keep]


def plain_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_conversation(engine, config, turns=4):
    """The agent loop: each turn sends the whole conversation, the reply appended as text."""
    messages, rows, earlier = [{"role": "system", "content": SYSTEM}], [], 0
    for turn in range(turns):
        messages.append({"role": "user", "content": USERS[turn]})
        before = engine.stats
        (out,) = engine.generate([list(messages)], config)
        after = engine.stats
        rows.append(dict(messages=list(messages), out=out, earlier=earlier,
                         reused=after["prefill_tokens_reused"] - before["prefill_tokens_reused"],
                         computed=after["prefill_tokens_computed"] - before["prefill_tokens_computed"]))
        earlier = len(out.prompt_token_ids) + len(out.token_ids)
        messages.append({"role": "assistant", "content": out.text})
    return rows


def test_later_turns_reuse_the_earlier_turns_and_match_stock(model):
    tokenizer = chat_tokenizer(CHAT)
    engine = ChunkLlamaEngine(model, tokenizer, chunk_size=CHUNK, max_batch_size=4)
    config = GenerationConfig(max_new_tokens=12, do_sample=False,
                              suppress_tokens=all_but_single_characters(tokenizer))
    rows = run_conversation(engine, config)
    retokenized_differently = 0
    for turn, r in enumerate(rows):
        out = r["out"]
        assert out.token_ids == stock_greedy(model, out.prompt_token_ids, config)
        # the text the model sees is the template's rendering (the ids differ where a reply re-tokenizes)
        rendered = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == rendered
        retokenized_differently += out.prompt_token_ids != plain_ids(tokenizer, r["messages"])
        if turn == 0:
            continue
        previous = rows[turn - 1]["out"]
        # the earlier prompt and every generated token but the last (never fed) are its prefix
        earlier_ids = previous.prompt_token_ids + previous.token_ids
        assert out.prompt_token_ids[: r["earlier"] - 1] == earlier_ids[:-1]
        # everything the earlier turns cached is reused (the full chunks shared, the last, partly filled
        # one copied from where the finished request left it): only the new tokens are computed
        assert r["reused"] == r["earlier"] - 1 and r["reused"] >= 0.95 * r["earlier"]
        assert r["computed"] == len(out.prompt_token_ids) - r["reused"]
    # the replies are written in ids the tokenizer would not choose: rendering anew would stop the match
    assert retokenized_differently == 3 and engine.inputs.conversations.num_continued == 3
    engine.close()


def test_template_that_rewrites_earlier_turns_falls_back_to_plain_rendering(model, caplog):
    tokenizer = chat_tokenizer(COUNTED)
    engine = ChunkLlamaEngine(model, tokenizer, chunk_size=CHUNK, max_batch_size=4)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, suppress_tokens=NOT_IN_REPLIES)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.engine.conversation"):
        rows = run_conversation(engine, config, turns=3)
    warnings = [r.getMessage() for r in caplog.records if r.name == "chunk_llama.engine.conversation"]
    assert len(warnings) <= 1 and engine.inputs.conversations.num_continued == 0
    if warnings:  # once per process: an earlier test may have logged it already
        assert "renders the earlier turns differently" in warnings[0]
    for r in rows:
        assert r["out"].prompt_token_ids == plain_ids(tokenizer, r["messages"])
        assert r["out"].token_ids == stock_greedy(model, r["out"].prompt_token_ids, config)
    engine.close()


def test_an_edited_reply_is_rendered_as_sent(model):
    tokenizer = chat_tokenizer(CHAT)
    engine = ChunkLlamaEngine(model, tokenizer, chunk_size=CHUNK, max_batch_size=4)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, suppress_tokens=NOT_IN_REPLIES)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]}]
    (out,) = engine.generate([messages], config)
    edited = messages + [{"role": "assistant", "content": out.text + " then go"},
                         {"role": "user", "content": USERS[1]}]
    assert engine.tokenize(edited) == plain_ids(tokenizer, edited)
    assert engine.inputs.conversations.num_continued == 0
    engine.close()
