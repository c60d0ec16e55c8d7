"""Tests of jax_ppo.data.prompts: bad prompts are refused at construction (naming the prompt and
the position), and the order is a pure function of the seed and the position (resumable, the same
on every host)."""

from __future__ import annotations

import numpy as np
import pytest

from jax_ppo.data import PromptDataset


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([], r"The prompt dataset is empty; pass at least one prompt"),
        ([[1], []], r"Prompt 1 of the dataset is empty"),
        ([[1], "the movie"], r"Prompt 1 of the dataset is text \('the movie'\); pass token ids"),
        ([[1, 2.5]], r"Prompt 0 of the dataset has 2.5 at position 1; token ids are ints >= 0"),
        ([[3], [4, 5, -1]], r"Prompt 1 of the dataset has -1 at position 2"),
        ([[True, 3]], r"Prompt 0 of the dataset has True at position 0"),
        ([np.array([1.0, 2.0])], r"Prompt 0 of the dataset has 1.0 at position 0"),
        ([[[1, 2]]], r"Prompt 0 of the dataset has \[1, 2\] at position 0"),
    ],
)
def test_bad_prompts_are_refused(prompts, message):
  with pytest.raises(ValueError, match=message):
    PromptDataset(prompts)


def test_texts_must_match_the_prompts():
  with pytest.raises(ValueError, match="`texts` has 1 entries for 2 prompts"):
    PromptDataset([[1], [2]], texts=["a"])


def test_ids_of_any_integer_type_are_kept_as_ints():
  data = PromptDataset([np.array([1, 2], np.int32), [np.int64(3)], (4, 5)])
  assert data.prompts == [[1, 2], [3], [4, 5]]
  assert all(type(t) is int for p in data.prompts for t in p)


def test_order_depends_only_on_seed_and_position():
  data = PromptDataset([[i + 1] for i in range(10)], seed=7)
  again = PromptDataset([[i + 1] for i in range(10)], seed=7)
  batches = [data.indices(k, 4) for k in range(6)]  # 24 draws: crosses two epoch boundaries
  assert batches == [again.indices(k, 4) for k in range(6)]
  flat = sum(batches, [])
  assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
  assert flat[:10] != flat[10:20]  # reshuffled every epoch
  assert flat[:10] != sorted(flat[:10])
  assert PromptDataset([[i + 1] for i in range(10)], seed=8).indices(0, 10) != flat[:10]
  ordered = PromptDataset([[i + 1] for i in range(10)], shuffle=False)
  assert ordered.indices(1, 4) == [4, 5, 6, 7] and ordered.indices(2, 4) == [8, 9, 0, 1]
  ids, texts = data.batch(2, 4)
  assert ids == [[i + 1] for i in data.indices(2, 4)] and texts is None
