"""A sample's logits processors run as transformers' `LogitsProcessorList` runs them, bit for
bit (`engine/processors.py`), and a sequence's `input_ids` tensor grows with it
(`Sequence.ids_tensor`)."""

import math

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from chunk_llama.engine import processors
from chunk_llama.engine.request import SampleGroup, Sequence

VOCAB = 37


def scores() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    out = torch.randn(1, VOCAB, generator=g)
    out[0, 3], out[0, 11] = math.inf, -math.inf
    return out


@pytest.mark.parametrize("eos", [[2], [2, 7, VOCAB + 5, -1], torch.tensor([7, 2])])
@pytest.mark.parametrize("length", [5, 9, 10, 11, 30])
def test_the_eos_minimum_processors_give_what_transformers_gives(eos, length):
    ids = torch.arange(length)[None] % VOCAB
    for processor in (MinLengthLogitsProcessor(10, eos), MinNewTokensLengthLogitsProcessor(4, 6, eos),
                      RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.7)):
        chain = LogitsProcessorList([processor, MinLengthLogitsProcessor(length + 1, [5])])
        got, want = processors.run(chain, ids, scores()), chain(ids, scores())
        assert got.dtype == want.dtype and torch.equal(got, want), (type(processor).__name__, length)


def test_a_processor_that_needs_more_arguments_fails_as_in_transformers():
    class NeedsMore(LogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            return scores

    chain = LogitsProcessorList([NeedsMore()])
    with pytest.raises(ValueError) as stock:
        chain(torch.zeros(1, 3, dtype=torch.long), scores())
    with pytest.raises(ValueError) as ours:
        processors.run(chain, torch.zeros(1, 3, dtype=torch.long), scores())
    assert str(ours.value) == str(stock.value)


def test_a_list_of_another_class_is_called_as_it_is():
    class Doubling(LogitsProcessorList):
        def __call__(self, input_ids, scores, **kwargs):
            return super().__call__(input_ids, scores) * 2

    chain = Doubling([TemperatureLogitsWarper(0.5)])
    assert torch.equal(processors.run(chain, torch.zeros(1, 3, dtype=torch.long), scores()), scores() / 0.5 * 2)


def test_ids_tensor_is_all_ids_as_they_grow():
    seq = Sequence(seq_id=0, request_id=0, index=0, prompt=None, prompt_ids=list(range(50)), max_new_tokens=500,
                   eos_token_ids=frozenset(), processors=None, criteria=None, do_sample=False,
                   group=SampleGroup(1, None))
    earlier = []
    for token in range(300):
        ids = seq.ids_tensor("cpu")
        assert ids.dtype == torch.int64 and torch.equal(ids, torch.tensor([seq.all_ids])), token
        earlier.append((ids, list(seq.all_ids)))
        seq.add_token(token % 97, None, None)
    assert all(torch.equal(ids, torch.tensor([values])) for ids, values in earlier)  # views given out kept theirs


def _greedy(prompt_length: int, processors_, keep_scores: bool = False) -> Sequence:
    seq = Sequence(seq_id=0, request_id=0, index=0, prompt=None, prompt_ids=list(range(prompt_length)),
                   max_new_tokens=50, eos_token_ids=frozenset(), processors=processors_, criteria=None,
                   do_sample=False, group=SampleGroup(1, None))
    seq.keep_scores = keep_scores
    return seq


def test_greedy_rows_under_eos_minimums_take_the_processed_scores_argmax():
    """select_tokens decides a greedy row whose processors only ban EOS tokens from the raw
    logits (`processors.banned_eos`) unless the raw argmax is banned: every case gives the token
    of the processed scores' argmax, as the full path computes it."""
    from chunk_llama.engine.sampler import select_tokens

    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[0, 2] = 9.0  # the raw argmax is EOS 2: banned below the minimum, the winner above it
    logits[1, 7], logits[1, 4] = 9.0, 9.0  # EOS 7 ties token 4 before it: 4 either way
    logits[2, 2], logits[2, 30] = 9.0, 9.0  # EOS 2 ties token 30 after it: 30 while 2 is banned
    logits[3, 5] = math.nan  # NaN wins (torch's rule) where it is no banned token
    logits[4, 2] = math.nan  # a NaN at a banned EOS: the processed row's argmax
    logits[5] = -math.inf  # every score -inf: the first index
    logits[6, 2] = 9.0  # under a processor that is not EOS-only: the full path
    logits[7, 7] = 9.0  # keeps its scores: the full path, scores returned
    for prompt_length in (3, 12):  # below the minimum of 10 tokens, then past it
        chains = [LogitsProcessorList([MinLengthLogitsProcessor(10, [2, 7])]),
                  LogitsProcessorList([MinNewTokensLengthLogitsProcessor(prompt_length, 5, torch.tensor([7, 2]))])]
        for chain in chains:
            seqs = [_greedy(prompt_length, chain) for _ in range(6)]
            seqs.append(_greedy(prompt_length, LogitsProcessorList([*chain, RepetitionPenaltyLogitsProcessor(1.3)])))
            seqs.append(_greedy(prompt_length, chain, keep_scores=True))
            tokens, kept = select_tokens(seqs, logits)
            for i, seq in enumerate(seqs):
                ids = torch.arange(prompt_length)[None]
                want = seq.processors(ids, logits[i : i + 1].clone())
                assert tokens[i] == int(want.argmax(-1)), (prompt_length, type(chain[0]).__name__, i)
                assert (kept[i] is not None) == seq.keep_scores, i
                if seq.keep_scores:
                    assert torch.equal(kept[i], want[0]), i


def test_argmax_rows_is_torchs_argmax():
    from chunk_llama.engine.sampler import argmax_rows

    g = torch.Generator().manual_seed(2)
    for trial in range(200):
        rows = torch.randint(-2, 2, (3, 17 + trial % 5), generator=g).float()
        rows[trial % 3, trial % 7] = (math.nan, math.inf, -math.inf, -0.0)[trial % 4]
        for x in (rows, rows[:, 1:], rows.bfloat16()):  # (a strided view; bfloat16 goes to torch)
            assert argmax_rows(x) == x.argmax(-1).tolist(), trial
