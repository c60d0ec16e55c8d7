"""An id outside the vocabulary never reaches a model: the Sampler checks its pad and stop ids when
built and every prompt id on the host; pad ids inside prompt text stay real tokens."""

import jax
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models import VocabularyError, check_token_ids
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.transformer import CausalLM
from jax_ppo.rollout.batching import left_pad_prompts
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler

V = 61
CONFIG = ModelConfig(
    model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)


def _sampling(**kwargs):
  base = dict(max_new_tokens=6, stop_token_ids=(3,), pad_token_id=0, prompt_buckets=(8,),
              batch_buckets=(4,))
  return SamplingConfig(**{**base, **kwargs})


@pytest.fixture(scope="module")
def model():
  return CausalLM(CONFIG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(pad_token_id=None), "pad_token_id"), (dict(pad_token_id=-1), "pad_token_id"),
     (dict(pad_token_id=True), "pad_token_id"), (dict(pad_token_id=1.5), "pad_token_id"),
     (dict(stop_token_ids=(-2,)), "stop_token_ids"), (dict(stop_token_ids=3), "stop_token_ids"),
     (dict(stop_token_ids=("</s>",)), "stop_token_ids")],
)
def test_sampling_config_rejects_values_that_are_not_token_ids(kwargs, field):
  with pytest.raises(ValueError, match=f"SamplingConfig.{field}="):
    _sampling(**kwargs)
  normalised = _sampling(pad_token_id=np.int64(5), stop_token_ids=[np.int32(3), 4])
  assert normalised.pad_token_id == 5 and type(normalised.pad_token_id) is int
  assert normalised.stop_token_ids == (3, 4) and hash(normalised)


def test_sampler_checks_pad_and_stop_ids_against_the_vocabulary(model):
  with pytest.raises(VocabularyError, match=rf"pad_token_id .*holds {V}, .*vocabulary of {V}"):
    Sampler(model, _sampling(pad_token_id=V))
  with pytest.raises(VocabularyError, match=rf"stop_token_ids .*holds 200, .*vocabulary of {V}"):
    Sampler(model, _sampling(stop_token_ids=(3, 200)))
  Sampler(model, _sampling(pad_token_id=V - 1, stop_token_ids=(0,)))  # the edges are fine


def test_out_of_range_prompt_id_is_named_before_anything_runs(model):
  # Without the check the id would embed as NaN (jnp.take fills out-of-range rows).
  graphdef, state = nnx.split(model)
  logits = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(state, np.array([[5, V]]))
  assert np.isnan(np.asarray(logits)[0, 1]).all()

  sampler = Sampler(model, _sampling())
  key = jax.random.PRNGKey(0)
  with pytest.raises(VocabularyError,
                     match=rf"row 1 has token id {V} at position 2, .*vocabulary of {V} ids"):
    sampler([[5, 6], [7, 8, V, 9]], key)
  with pytest.raises(VocabularyError, match="row 0 has token id -4 at position 0"):
    sampler([[-4, 6]], key)
  assert sampler.compile_count == 0  # nothing reached the device
  rollout = sampler([[5, 6], [7, 8, V - 1, 9]], key)
  assert np.isfinite(np.asarray(rollout.logprobs)).all()


def test_left_pad_prompts_checks_the_whole_prompt_even_when_truncating():
  config = _sampling(truncate_prompts=True)
  long = [V + 7] + [5] * 60  # the bad id would be cut off, but it reveals a tokenizer mismatch
  with pytest.raises(VocabularyError, match=rf"row 0 has token id {V + 7}"):
    left_pad_prompts([long], config, max_context=48, vocab_size=V)
  ids, mask = left_pad_prompts([long], config, max_context=48)  # no vocab_size: no check
  assert ids.shape == (1, 42) and mask.all()


def test_check_token_ids_names_position_and_rejects_non_integers():
  with pytest.raises(VocabularyError, match=r"batch has token id 9 at position \(1, 0\)"):
    check_token_ids(np.array([[1, 2], [9, 3]]), 9, what="batch")
  with pytest.raises(VocabularyError, match="float64 values"):
    check_token_ids([1.0, 2.0], 9, what="ids")
  check_token_ids([], 9, what="nothing")
  check_token_ids(np.arange(9), 9, what="all ids")


def test_pad_id_inside_prompt_text_is_a_real_token(model):
  """Llama 2's PAD is `<unk>`, which also occurs in text: masks, never ids, mark padding."""
  prompts = [[5, 0, 6], [1, 1, 7, 0, 0], [0]]  # ids 0 and 1 occur as text
  key = jax.random.PRNGKey(3)
  a = Sampler(model, _sampling(pad_token_id=0, greedy=True))(prompts, key)
  b = Sampler(model, _sampling(pad_token_id=1, greedy=True))(prompts, key)
  for r in (a, b):
    np.testing.assert_array_equal(np.asarray(r.prompt_mask).sum(1), [3, 5, 1])
  np.testing.assert_array_equal(np.asarray(a.prompt_mask), np.asarray(b.prompt_mask))
  np.testing.assert_array_equal(np.asarray(a.response_mask), np.asarray(b.response_mask))
  m = np.asarray(a.response_mask)
  np.testing.assert_array_equal(np.asarray(a.response_ids)[m], np.asarray(b.response_ids)[m])
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(a.positions), np.asarray(b.positions))


def test_eager_calls_check_ids_and_jitted_calls_stay_unchecked(model):
  from jax_ppo.ppo.batch import batch_view
  from jax_ppo.ppo.forward import masked_logprobs

  with pytest.raises(VocabularyError, match=rf"input_ids has token id {V} at position \(0, 1\)"):
    model(np.array([[5, V, 6]]))
  rollout = Sampler(model, _sampling())([[5, 6]], jax.random.PRNGKey(0))
  bad = rollout.replace(response_ids=rollout.response_ids.at[0, 0].set(V + 3))
  with pytest.raises(VocabularyError, match=f"token id {V + 3}"):
    masked_logprobs(model, batch_view(bad), temperature=1.0)
  # Under jit the ids are traced: no host check in the hot path (the Sampler checked them).
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, r: masked_logprobs(nnx.merge(graphdef, s), batch_view(r),
                                               temperature=1.0))
  assert np.isfinite(np.asarray(run(state, rollout))).all()
