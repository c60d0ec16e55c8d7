"""Packed rows (`segment_ids`): each sequence's logits equal those of the sequence run alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.data.sft import SFTExample, pack_examples
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.packing import restrict_to_segments
from jax_ppo.models.transformer import CausalLM

LLAMA = ModelConfig(
    model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32,
)
CONFIGS = {
    "llama": LLAMA,
    # Learned absolute positions: a wrong restart of the positions changes the embeddings.
    "gpt2": dataclasses.replace(
        LLAMA, model_type="gpt2", norm_type="layer", activation="gelu_new", gated_mlp=False,
        position_embedding="learned", qkv_bias=True, out_bias=True, mlp_bias=True,
        num_kv_heads=4,
    ),
    # A sliding window of 3 compares positions: they must be the in-segment ones.
    "window": dataclasses.replace(LLAMA, model_type="mistral", sliding_window=3),
}


def _model(config, seed=0):
  model = CausalLM(config, rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model)
  # Larger weights than the default init, so that a wrong mask or position shows in the logits.
  state = jax.tree.map(
      lambda x, k: x + 0.3 * jax.random.normal(k, x.shape, x.dtype),
      state, jax.tree.unflatten(jax.tree.structure(state),
                                list(jax.random.split(jax.random.PRNGKey(seed + 1),
                                                      len(jax.tree.leaves(state))))),
  )
  return jax.jit(lambda ids, mask, pos, seg: nnx.merge(graphdef, state)(
      ids, mask, positions=pos, segment_ids=seg)), jax.jit(
      lambda ids, mask: nnx.merge(graphdef, state)(ids, mask))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_logits_equal_each_sequence_alone(name):
  packed_fn, plain_fn = _model(CONFIGS[name])
  rng = np.random.default_rng(0)
  examples = [SFTExample(tuple(rng.integers(3, 40, size=p)), tuple(rng.integers(3, 40, size=r)))
              for p, r in ((3, 4), (2, 5), (4, 1))]
  rows = pack_examples(examples, max_length=24, pad_token_id=0)
  assert rows.num_rows == 1 and rows.attention_mask.sum() == 19  # three examples, 5 pad slots
  for positions in (jnp.asarray(rows.positions), None):  # given, or derived from the segments
    logits = np.asarray(packed_fn(jnp.asarray(rows.input_ids), jnp.asarray(rows.attention_mask),
                                  positions, jnp.asarray(rows.segment_ids)))
    offset = 0
    for ex in examples:
      ids = np.asarray(ex.prompt_ids + ex.response_ids)[None]
      alone = np.asarray(plain_fn(jnp.asarray(ids), jnp.ones(ids.shape, bool)))
      np.testing.assert_allclose(logits[0, offset : offset + ids.shape[1]], alone[0],
                                 atol=2e-5, rtol=2e-5)
      offset += ids.shape[1]


def test_without_packing_logits_differ():
  """The check above can fail: without segment ids the second sequence sees the first."""
  packed_fn, plain_fn = _model(LLAMA)
  ids = jnp.asarray(np.arange(3, 13)[None])
  mask = jnp.ones((1, 10), bool)
  seg = jnp.asarray([[1] * 4 + [2] * 6])
  positions = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
  packed = np.asarray(packed_fn(ids, mask, positions, seg))
  crossing = np.asarray(packed_fn(ids, mask, positions, jnp.ones((1, 10), jnp.int32)))
  alone = np.asarray(plain_fn(ids[:, 4:], mask[:, 4:]))
  np.testing.assert_allclose(packed[0, 4:], alone[0], atol=2e-5, rtol=2e-5)
  assert np.abs(crossing[0, 4:] - alone[0]).max() > 1e-2


def test_one_segment_is_the_unpacked_model():
  """A single segment per row (with padding) gives exactly the logits of the default path."""
  packed_fn, plain_fn = _model(LLAMA)
  ids = jnp.asarray(np.random.default_rng(1).integers(3, 40, size=(2, 7)))
  mask = jnp.asarray([[1] * 7, [1] * 5 + [0] * 2], bool)
  seg = mask.astype(jnp.int32)
  plain = np.asarray(plain_fn(ids, mask))
  packed = np.asarray(packed_fn(ids, mask, None, seg))
  np.testing.assert_allclose(packed[mask], plain[mask], atol=1e-6, rtol=1e-6)


def test_restrict_to_segments_positions_and_mask():
  valid = jnp.asarray([[1, 1, 1, 1, 1, 0]], bool)
  base = jnp.tril(jnp.ones((6, 6), bool))[None] & valid[:, None, :]
  seg = jnp.asarray([[1, 1, 2, 2, 2, 0]])
  mask, positions = restrict_to_segments(base, seg, None)
  np.testing.assert_array_equal(positions, [[0, 1, 0, 1, 2, 0]])
  assert not bool(mask[0, 2, 1]) and bool(mask[0, 3, 2]) and bool(mask[0, 1, 0])
  given = jnp.arange(6)[None]
  assert restrict_to_segments(base, seg, given)[1] is given


def test_segment_ids_shape_error():
  model = CausalLM(LLAMA, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="segment_ids"):
    model(jnp.ones((1, 4), jnp.int32), segment_ids=jnp.ones((1, 3), jnp.int32))
