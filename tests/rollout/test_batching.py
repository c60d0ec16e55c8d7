"""Tests for prompt left-padding and bucketing (jax_ppo/rollout/batching.py)."""

import numpy as np
import pytest

from jax_ppo.rollout.batching import left_pad_prompts
from jax_ppo.rollout.config import SamplingConfig


def test_left_pads_to_the_smallest_bucket():
  cfg = SamplingConfig(max_new_tokens=8, prompt_buckets=(4, 8, 16), pad_token_id=9)
  ids, mask = left_pad_prompts([[1, 2, 3], [4, 5, 6, 7, 1]], cfg, max_context=64)
  assert ids.shape == (2, 8)
  np.testing.assert_array_equal(ids[0], [9, 9, 9, 9, 9, 1, 2, 3])
  np.testing.assert_array_equal(mask[1], [0, 0, 0, 1, 1, 1, 1, 1])


def test_bucket_count_is_bounded_across_lengths():
  cfg = SamplingConfig(max_new_tokens=8, prompt_buckets=(4, 8, 16))
  shapes = {left_pad_prompts([[1] * n], cfg, max_context=40)[0].shape for n in range(1, 33)}
  assert shapes == {(1, 4), (1, 8), (1, 16), (1, 32)}  # 32 = context budget 40 - 8


def test_empty_prompt_names_the_row():
  with pytest.raises(ValueError, match="row 1"):
    left_pad_prompts([[1], []], SamplingConfig(), max_context=128)


def test_too_long_prompt_raises_or_truncates():
  cfg = SamplingConfig(max_new_tokens=4, prompt_buckets=(8,))
  with pytest.raises(ValueError, match="row 0.*truncate_prompts"):
    left_pad_prompts([list(range(1, 10))], cfg, max_context=12)
  cfg = SamplingConfig(max_new_tokens=4, prompt_buckets=(8,), truncate_prompts=True)
  ids, mask = left_pad_prompts([list(range(1, 10))], cfg, max_context=12)
  np.testing.assert_array_equal(ids[0], range(2, 10))  # the last 8 tokens are kept
  assert mask.all()


def test_no_room_for_a_prompt():
  with pytest.raises(ValueError, match="max_new_tokens"):
    left_pad_prompts([[1]], SamplingConfig(max_new_tokens=16), max_context=16)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"n_samples": 0}, "n_samples"),
        ({"stop_token_ids": (2,), "pad_token_id": 2}, "pad_token_id"),
        ({"prompt_buckets": (8, 4)}, "prompt_buckets"),
        ({"batch_buckets": ()}, "batch_buckets"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    SamplingConfig(**kwargs)
