"""The length-bucketed decode (`SamplingConfig.decode_segments`, `segment_schedule`): tokens and
log-probs equal the one-loop decode's for every family, sliding windows included."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jax_ppo.models.config import ModelConfig, config_from_hf
from jax_ppo.models.lora import LoRAConfig, add_lora
from jax_ppo.models.transformer import CausalLM
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler, segment_schedule

PAD, VOCAB = 0, 61
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [4], [20, 21]]
T = 17  # 16 decode steps: 4 loops of 4 steps at K = 4
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=96)
FAMILIES = {
    "llama": ModelConfig(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=96),
    "gpt2": ModelConfig(
        model_type="gpt2", vocab_size=VOCAB, hidden_size=32, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, max_position_embeddings=96,
        norm_type="layer", activation="gelu_new", gated_mlp=False,
        position_embedding="learned", qkv_bias=True, out_bias=True, mlp_bias=True,
        norm_eps=1e-5),
    "qwen3": config_from_hf(transformers.Qwen3Config(**SMALL)),
    # Windows of 4 positions on alternate layers, well inside the 8 + 16 slots of a row.
    "gemma2": config_from_hf(transformers.Gemma2Config(
        **SMALL, query_pre_attn_scalar=12, sliding_window=4, attn_logit_softcapping=3.0,
        final_logit_softcapping=2.0)),
}


def _model(config: ModelConfig, *, lora: bool = False) -> CausalLM:
  """A random model with weights of std ~0.3 (not the 0.02 init), so greedy paths are not flat;
  with `lora`, adapters on every projection with a non-zero `B`."""
  model = CausalLM(config, rngs=nnx.Rngs(0))
  if lora:
    add_lora(model, LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
            for x, k in zip(leaves, keys, strict=True)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _config(**kwargs) -> SamplingConfig:
  base = dict(max_new_tokens=T, greedy=True, temperature=0.7, pad_token_id=PAD,
              prompt_buckets=(8, 16), batch_buckets=(4, 8), n_samples=2)
  return SamplingConfig(**{**base, **kwargs})


def _assert_same(a, b):
  np.testing.assert_array_equal(a.response_ids, b.response_ids)
  np.testing.assert_array_equal(a.response_mask, b.response_mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5, rtol=0)


def test_schedule_covers_every_step_once_and_reads_the_live_prefix():
  for s, t, k in [(8, 17, 4), (512, 512, 4), (32, 48, 3), (8, 3, 4), (16, 10, 1), (8, 100, 7)]:
    segments = segment_schedule(s, t, k)
    steps = [step for seg in segments for step in range(seg.start, seg.stop)]
    assert steps == list(range(1, t)), (s, t, k)
    assert len(segments) == min(k, t - 1)
    # Step `t` writes slot S + t - 1: its loop reads at least S + t slots, the last loop all.
    assert all(seg.attend_length == s + seg.stop - 1 for seg in segments)
    assert segments[-1].attend_length == s + t - 1
  assert segment_schedule(8, 1, 4) == ()
  assert segment_schedule(512, 512, 4)[0].attend_length == 640
  # The slots read per step average S + T (K + 1) / 2K, against S + T - 1 with one loop.
  segments = segment_schedule(512, 512, 4)
  average = sum(seg.steps * seg.attend_length for seg in segments) / 511
  assert average == pytest.approx(512 + 512 * 5 / 8, abs=1)
  with pytest.raises(ValueError, match="decode_segments"):
    SamplingConfig(decode_segments=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_segmented_greedy_decode_equals_one_loop(family):
  model = _model(FAMILIES[family], lora=family == "llama")
  key = jax.random.key(0)
  one = Sampler(model, _config(decode_segments=1))(PROMPTS, key)
  assert len({tuple(r) for r in np.asarray(one.response_ids)}) > 2  # not a constant path
  # 16 loops of one step each (every boundary) for the sliding windows; else uneven loops.
  k = 16 if family == "gemma2" else 5
  _assert_same(Sampler(model, _config(decode_segments=k))(PROMPTS, key), one)


def test_segmented_decode_with_early_stop_and_a_bf16_cache():
  """Every row stops within the first two loops (stop ids: each row's greedy token at step 6),
  so the later loops run no step; the result equals the one-loop decode's and the decode's
  without early stop."""
  model = _model(FAMILIES["gemma2"])
  key = jax.random.key(1)
  free = np.asarray(Sampler(model, _config())(PROMPTS, key).response_ids)
  stops = tuple(sorted({int(x) for x in free[:, 6]} - {PAD}))
  cfg = _config(stop_token_ids=stops)
  for cache_dtype in (None, jnp.bfloat16):
    one = Sampler(model, dataclasses.replace(cfg, decode_segments=1),
                  cache_dtype=cache_dtype)(PROMPTS, key)
    assert bool(one.has_stop.all()) and int(one.response_lengths.max()) <= 7
    seg = Sampler(model, cfg, cache_dtype=cache_dtype)(PROMPTS, key)
    _assert_same(seg, one)
    full = Sampler(model, dataclasses.replace(cfg, early_stop=False),
                   cache_dtype=cache_dtype)(PROMPTS, key)
    _assert_same(full, seg)


def test_sampled_decode_agrees_and_compiles_once():
  model = _model(FAMILIES["qwen3"])
  cfg = _config(greedy=False, temperature=1.0, n_samples=3)
  sampler = Sampler(model, cfg)
  a = sampler(PROMPTS, jax.random.key(3))
  b = sampler(PROMPTS[::-1], jax.random.key(4))
  assert sampler.compile_count == 1  # the K loops are one program
  _assert_same(a, Sampler(model, dataclasses.replace(cfg, decode_segments=1))(
      PROMPTS, jax.random.key(3)))
  assert b.response_ids.shape == (12, T)
