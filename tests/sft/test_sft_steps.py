"""SFT steps (`jax_ppo.sft.steps`): the loss through the chunked LM-head path equals the
full-logits loss of a NumPy log-softmax reference, and the compiled train step holds no
full-vocabulary `[B, L, V]` float32 logits once they are chunked."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.data.sft import example_from_ids, pack_examples
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.transformer import CausalLM
from jax_ppo.sft import SFTBatch, SFTConfig, SFTOptimizer, SFTSteps, SFTTrainer, sft_loss
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.state import init_stage_state

EOS = 2
# A vocabulary much wider than the model, so that the logits dominate the step's memory.
WIDE = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=8, intermediate_size=16,
                   num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                   max_position_embeddings=64)
CONFIG = SFTConfig(max_length=64, batch_size=4, gradient_accumulation_steps=2, packing=True,
                   eos_token_id=EOS, total_steps=4,
                   optimizer=SFTOptimizer(learning_rate=1e-2, lr_schedule="constant"))


def _examples(n: int, *, seed: int = 0, vocab: int = WIDE.vocab_size):
  rng = np.random.default_rng(seed)
  return [example_from_ids(rng.integers(3, vocab, size=int(rng.integers(1, 6))),
                           rng.integers(3, vocab, size=int(rng.integers(1, 7))),
                           eos_token_id=EOS) for _ in range(n)]


def _numpy_loss(model, batch: SFTBatch) -> tuple[float, float]:
  """Reference: the full `[B, L, V]` logits, log-softmax in float64 NumPy, the targets' NLL summed
  over the loss mask; returns `(summed NLL, token count)`."""
  logits = jax.jit(lambda b: model(b.input_ids, b.attention_mask, positions=b.positions,
                                   segment_ids=b.segment_ids))(batch)
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, np.asarray(batch.targets)[..., None], -1)[..., 0]
  mask = np.asarray(batch.loss_mask)
  return float(-(picked * mask).sum()), float(mask.sum())


@pytest.fixture(scope="module")
def packed():
  """A packed batch of 4 rows (several examples per row) and a model over `WIDE`."""
  rows = pack_examples(_examples(40), max_length=CONFIG.max_length, pad_token_id=0)
  rows = rows.take(np.arange(CONFIG.batch_size))
  assert rows.segment_ids.max() >= 2  # several examples share a row
  return CausalLM(WIDE, rngs=nnx.Rngs(0)), SFTBatch.from_rows(rows, packed=True)


def _steps(model, *, chunk_bytes):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  optimizer, schedule = make_optimizer(CONFIG.optimizer, CONFIG.total_steps)
  steps = SFTSteps(CONFIG, graphdef=graphdef, optimizer=optimizer, schedule=schedule)
  steps.logits_chunk_bytes = chunk_bytes
  params = jax.tree.map(jnp.copy, params)  # (the train step donates them; the model keeps its)
  return steps, init_stage_state(optimizer, params), rest


@pytest.mark.parametrize("chunk_bytes", [3 * 4 * 4 * WIDE.vocab_size, None])
def test_chunked_loss_equals_the_full_logits_numpy_loss(packed, chunk_bytes):
  """Chunks of 3 positions for 4 rows, 6 for the 2 rows of a microbatch (64 is a multiple of
  neither: the last chunk is padded), or none."""
  model, batch = packed
  steps, state, rest = _steps(model, chunk_bytes=chunk_bytes)
  want_sum, want_n = _numpy_loss(model, batch)
  logprobs = jax.jit(steps.target_logprobs)(state.params, rest, batch)
  np.testing.assert_allclose(float(sft_loss(logprobs, batch.loss_mask)), want_sum / want_n,
                             rtol=1e-6)
  nll, n = steps.eval_sums(state.params, rest, batch)
  assert float(n) == want_n
  np.testing.assert_allclose(float(nll) / float(n), want_sum / want_n, rtol=1e-6)
  _, metrics = steps.train_step(state, rest, batch)  # (2 microbatches, global normalisation)
  np.testing.assert_allclose(float(metrics["train/loss"]), want_sum / want_n, rtol=1e-6)
  assert float(metrics["train/tokens"]) == want_n


def test_chunked_and_full_gradients_agree(packed):
  model, batch = packed
  grads = []
  for chunk_bytes in (3 * 4 * 4 * WIDE.vocab_size, None):
    steps, state, rest = _steps(model, chunk_bytes=chunk_bytes)
    loss = jax.jit(jax.grad(steps.micro_loss))
    grads.append(loss(state.params, rest, batch, jnp.sum(batch.loss_mask)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), *grads)


def test_the_train_step_holds_no_full_vocabulary_float32_logits(packed):
  """XLA's own account of the compiled step's scratch memory: with the full logits it holds at
  least one microbatch's `[B / 2, L, V]` float32 logits (the whole batch's `[B, L, V]` is twice
  that); chunked over 1 position it holds a third of them at most (gradients and the update
  remain)."""
  model, batch = packed
  length = batch.input_ids.shape[1]
  full_logits = CONFIG.microbatch_size * length * WIDE.vocab_size * 4

  def temp_bytes(chunk_bytes):
    steps, state, rest = _steps(model, chunk_bytes=chunk_bytes)
    compiled = steps.train_step.lower(state, rest, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(None) >= full_logits  # the test can see the buffer when it is there
  assert temp_bytes(4 * CONFIG.microbatch_size * WIDE.vocab_size) < full_logits / 3


def test_trainer_steps_take_the_chunk_limit(packed):
  """`SFTTrainer` trains through the chunked path: its loss equals the reference at a limit of
  one position per chunk."""
  model, _ = packed
  examples = _examples(8, seed=1)
  trainer = SFTTrainer(dataclasses.replace(CONFIG, packing=False), model, train_data=examples,
                       eval_data=examples)
  trainer.steps.logits_chunk_bytes = 4 * CONFIG.microbatch_size * WIDE.vocab_size
  rows = trainer.eval_rows
  want_sum, want_n = _numpy_loss(trainer.model(), SFTBatch.from_rows(rows, packed=False))
  got = trainer.evaluate()
  assert got["eval/tokens"] == want_n
  np.testing.assert_allclose(got["eval/loss"], want_sum / want_n, rtol=1e-6)
