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
