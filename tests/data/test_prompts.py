"""Tests of jax_ppo.data.prompts: bad prompts are refused at construction (naming the prompt and
the position), the order is a pure function of the seed and the position (resumable, the same
on every host), and each process's shard of a batch is its contiguous part of the global batch."""

from __future__ import annotations

import types

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ppo.data import PromptDataset
from jax_ppo.data.prompts import jax_process_shard


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


def test_order_is_a_grain_dataset_of_per_epoch_permutations():
  data = PromptDataset([[i + 1] for i in range(7)], seed=11)
  assert isinstance(data.order, grain.MapDataset)
  want = [int(i) for e in range(3) for i in np.random.default_rng([11, e]).permutation(7)]
  assert sum((data.indices(k, 3) for k in range(7)), []) == want
  assert [data.order[k] for k in range(21)] == want


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), shards=st.sampled_from([1, 2, 4]), per_shard=st.integers(1, 3),
       position=st.integers(0, 20), seed=st.integers(0, 2**32 - 1))
def test_shards_concatenate_to_the_global_batch(n, shards, per_shard, position, seed):
  data = PromptDataset([[i + 1] for i in range(n)], seed=seed)
  batch_size = shards * per_shard
  parts = [data.indices(position, batch_size,
                        shard=grain.sharding.ShardOptions(shard_index=i, shard_count=shards))
           for i in range(shards)]
  assert sum(parts, []) == data.indices(position, batch_size)
  ids, _ = data.batch(position, batch_size, shard=grain.sharding.ShardOptions(0, shards))
  assert ids == [[i + 1] for i in parts[0]]


def test_one_process_shard_is_the_whole_batch():
  data = PromptDataset([[i + 1] for i in range(10)], seed=3)
  assert data.indices(4, 6, shard=jax_process_shard()) == data.indices(4, 6)


@pytest.mark.parametrize("call, message", [
    (lambda d: d.indices(0, 6, shard=grain.sharding.ShardOptions(0, 4)),
     r"batch_size=6 is not a multiple of the 4 shards"),
    (lambda d: d.indices(0, 4, shard=types.SimpleNamespace(shard_index=4, shard_count=4)),
     r"shard index 4 of 4 is invalid"),
    (lambda d: d.indices(-1, 4), r"position=-1 is invalid"),
    (lambda d: d.batch(0, 0), r"batch_size=0 is invalid"),
])
def test_bad_positions_and_shards(call, message):
  with pytest.raises(ValueError, match=message):
    call(PromptDataset([[1], [2]]))


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True])
def test_bad_seeds(seed):
  with pytest.raises(ValueError, match=r"PromptDataset seed=.* is invalid: use an int in"):
    PromptDataset([[1]], seed=seed)
