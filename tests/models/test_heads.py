"""Reward and value heads: SequenceClassification loading, last-valid-token reads, inits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from tests.models.conftest import hf_config, left_padded_batch

torch = pytest.importorskip("torch", reason="HF reference models are built with PyTorch")


def _jit_score(model):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, i, m: nnx.merge(graphdef, s).score(i, attention_mask=m))
  return lambda ids, mask: np.asarray(fn(state, ids, mask))


@pytest.mark.parametrize("name", ["gpt2", "llama3_gqa_tied", "qwen3"])
def test_sequence_classification_scores_match_hf(name, hf_checkpoint):
  hf, path = hf_checkpoint(name, seq_cls=True)
  model = models.load_scalar_model(path)
  ids, mask = left_padded_batch()  # Pad slots hold id 0 = the config's pad_token_id.
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(pos)).logits.numpy()[:, 0]
  ours = _jit_score(model)(ids, mask)
  np.testing.assert_allclose(ours, ref, atol=1e-4)
  assert np.abs(np.asarray(model.score_head.bias)).max() == 0


def test_score_reads_the_last_valid_token_with_right_padding(hf_checkpoint):
  _, path = hf_checkpoint("qwen2", seq_cls=True)
  model = models.load_scalar_model(path)
  ids, _ = left_padded_batch(pads=(0, 0, 0))
  mask = np.ones_like(ids)
  mask[1, 6:] = 0  # Right padding: the response ended at index 5.
  mask[2, :2] = 0
  mask[2, 7:] = 0  # Both sides: last valid index 6.
  per_token = np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask))
  scores = _jit_score(model)(ids, mask)
  np.testing.assert_allclose(scores, per_token[[0, 1, 2], [8, 5, 6]], atol=1e-6)
  # Whatever sits after the last valid token does not change the score.
  other = ids.copy()
  other[1, 6:] = 7
  np.testing.assert_allclose(_jit_score(model)(other, mask), scores, atol=1e-6)


def test_read_last_valid():
  x = jnp.arange(12.0).reshape(3, 4)
  mask = jnp.array([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
  np.testing.assert_array_equal(models.read_last_valid(x, mask), [1.0, 7.0, 8.0])


def test_reward_model_from_causal_lm_trunk_and_value_copy(hf_checkpoint):
  _, path = hf_checkpoint("llama2")
  policy = models.from_pretrained(path)
  reward = models.load_scalar_model(path, seed=1)
  ids, mask = left_padded_batch()
  h_policy = np.asarray(policy.hidden_states(ids, attention_mask=mask))
  h_reward = np.asarray(reward.hidden_states(ids, attention_mask=mask))
  np.testing.assert_allclose(h_reward, h_policy, atol=1e-6)
  w = np.asarray(reward.score_head.kernel[...])
  assert w.shape == (32, 1) and w.std() > 0
  value = models.value_model_from_reward_model(reward)
  np.testing.assert_array_equal(
      np.asarray(value(ids, attention_mask=mask)), np.asarray(reward(ids, attention_mask=mask))
  )
  value.score_head.kernel[...] = jnp.zeros((32, 1))
  assert np.asarray(reward.score_head.kernel[...]).std() > 0  # Independent copy.
  # A reward checkpoint's head can be replaced by a fresh one on request.
  _, rm_path = hf_checkpoint("llama2", seq_cls=True)
  fresh = models.load_scalar_model(rm_path, head_init="zeros")
  assert float(jnp.abs(fresh.score_head.kernel[...]).max()) == 0


def test_value_head_on_policy_trunk(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  policy = models.from_pretrained(path)
  with pytest.raises(ValueError, match="value head"):
    policy.values_from_hidden(jnp.zeros((1, 2, 32)))
  policy.add_value_head()
  ids, mask = left_padded_batch()
  logits, hidden = policy(ids, attention_mask=mask, return_hidden=True)
  assert hidden.shape == (3, 9, 32) and logits.shape == (3, 9, 160)
  values = policy.values_from_hidden(hidden)
  assert values.shape == (3, 9) and values.dtype == jnp.float32
  assert float(jnp.abs(values).max()) == 0
  np.testing.assert_allclose(
      np.asarray(policy.hidden_states(ids, attention_mask=mask)), np.asarray(hidden), atol=1e-6
  )


def test_scalar_model_saves_as_sequence_classification(tmp_path):
  import transformers

  config = models.config.config_from_hf(hf_config("qwen2", pad_token_id=0))
  model = models.ScalarModel(config, rngs=nnx.Rngs(0))
  models.save_pretrained(model, str(tmp_path))
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
  ids, mask = left_padded_batch()
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(pos)).logits.numpy()[:, 0]
  np.testing.assert_allclose(_jit_score(model)(ids, mask), ref, atol=1e-4)
  # A head bias (HF heads have none) travels in config.json: load_scalar_model adds it back,
  # transformers leaves it out, and saving the loaded model again keeps it.
  model.rescale_scores(2.0, 0.75)
  models.save_pretrained(model, str(tmp_path / "b"))
  loaded = models.load_scalar_model(str(tmp_path / "b"))
  np.testing.assert_allclose(_jit_score(loaded)(ids, mask), 2.0 * ref + 0.75, atol=2e-4)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "b"))
  with torch.no_grad():
    out = hf.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos)).logits.numpy()[:, 0]
  np.testing.assert_allclose(out, 2.0 * ref, atol=2e-4)
  models.save_pretrained(loaded, str(tmp_path / "c"))
  again = models.load_scalar_model(str(tmp_path / "c"))
  np.testing.assert_allclose(_jit_score(again)(ids, mask), 2.0 * ref + 0.75, atol=2e-4)


def test_rescale_scores_is_affine_and_refuses_bad_gains():
  config = models.config.config_from_hf(hf_config("llama2", pad_token_id=0))
  model = models.ScalarModel(config, rngs=nnx.Rngs(1))
  ids, mask = left_padded_batch()
  before = _jit_score(model)(ids, mask)
  per_token = np.asarray(model(ids, attention_mask=mask))
  model.rescale_scores(0.5, -3.0)
  np.testing.assert_allclose(_jit_score(model)(ids, mask), 0.5 * before - 3.0, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(model(ids, attention_mask=mask)), 0.5 * per_token - 3.0,
                             rtol=1e-5, atol=1e-5)
  for gain, bias, match in ((0.0, 0.0, "gain"), (-1.0, 0.0, "gain"), (float("nan"), 0.0, "gain"),
                            (1.0, float("inf"), "bias")):
    with pytest.raises(ValueError, match=match):
      model.rescale_scores(gain, bias)
