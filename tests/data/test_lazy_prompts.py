"""`PromptDataset.lazy` and `read_prompts(lazy=True)`: a process of a multi-host run tokenizes
only the prompts of the batches (and shards) it reads, in the same order and with the same ids as
the eager dataset; a prompt that cannot be used is reported, with its line, when a batch first
reads it."""

from __future__ import annotations

import json

import grain
import pytest

from jax_ppo.data import PromptDataset
from jax_ppo.data.files import read_prompts
from tests import tiny_hf_run

PROMPTS = [[3 + i % 7] * (1 + i % 4) for i in range(11)]


def test_lazy_batches_equal_eager_ones_and_tokenize_only_what_they_read():
  calls = []

  def encode(i):
    calls.append(i)
    return PROMPTS[i], f"text {i}"

  eager = PromptDataset(PROMPTS, texts=[f"text {i}" for i in range(11)], seed=5)
  lazy = PromptDataset.lazy(11, encode, seed=5)
  assert len(lazy) == 11
  shard = grain.sharding.ShardOptions(1, 2)
  assert lazy.batch(0, 4, shard=shard) == eager.batch(0, 4, shard=shard)
  assert sorted(calls) == sorted(eager.indices(0, 4, shard=shard))  # 2 of the 4 rows
  for position in range(5):  # (the third batch crosses into the second epoch)
    assert lazy.batch(position, 4) == eager.batch(position, 4)
  assert len(calls) == len(set(calls)) == 11  # each prompt tokenized once


@pytest.mark.parametrize("size", [0, -1, 2.0, True])
def test_lazy_size_must_be_a_count(size):
  with pytest.raises(ValueError, match=r"PromptDataset.lazy size=.* is invalid"):
    PromptDataset.lazy(size, lambda i: ([1], None))


def test_lazy_prompts_are_checked_when_tokenized():
  lazy = PromptDataset.lazy(2, lambda i: ([4, -1] if i else [3], None), shuffle=False)
  assert lazy.batch(0, 1) == ([[3]], [None])
  with pytest.raises(ValueError, match=r"Prompt 1 of the dataset has -1 at position 1"):
    lazy.batch(1, 1)


def test_read_prompts_lazy_reports_a_bad_prompt_with_its_line_when_read(tmp_path):
  tok = tiny_hf_run.tokenizer()
  lines = [{"prompt": p} for p in tiny_hf_run.PROMPTS]
  good = tmp_path / "good.jsonl"
  good.write_text("".join(json.dumps(r) + "\n" for r in lines))
  eager, lazy = (read_prompts(good, tok, seed=1, lazy=flag) for flag in (False, True))
  assert lazy.prompts == [None] * len(lines)
  for position in range(3):
    assert lazy.batch(position, 4) == eager.batch(position, 4)
  assert lazy.prompts == eager.prompts and lazy.texts == eager.texts

  lines[5] = {"prompt": "the movie was very really not quite good great fun"}  # 10 tokens
  bad = tmp_path / "bad.jsonl"
  bad.write_text("".join(json.dumps(r) + "\n" for r in lines))
  with pytest.raises(ValueError, match=r"bad.jsonl.* line 6: the prompt has 10 tokens"):
    read_prompts(bad, tok, max_tokens=8)
  lazy = read_prompts(bad, tok, max_tokens=8, lazy=True, seed=1)  # nothing tokenized yet
  order = [lazy.indices(p, 1)[0] for p in range(8)]
  for position in range(order.index(5)):
    lazy.batch(position, 1)
  with pytest.raises(ValueError, match=r"bad.jsonl.* line 6: the prompt has 10 tokens, more "
                                       r"than the 8 that fit"):
    lazy.batch(order.index(5), 1)
