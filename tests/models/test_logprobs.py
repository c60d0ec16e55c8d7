"""The chunked log-prob path (`jax_ppo.models.logprobs.head_logprobs`) gives the numbers of the
unchunked path, with gradients (the teacher-forced pass over prompt + response that calls it:
tests/ppo/test_forward.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo import models
from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES, head_logprobs, logits_chunk
from tests.models.conftest import hf_config


def _close(got, want, what, rtol=1e-5, atol=1e-6):
  got, want = jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=what)


def _model():
  config = models.config.config_from_hf(hf_config("llama2"))
  return models.CausalLM(config, remat="none", rngs=nnx.Rngs(0))


def test_logits_chunk_rule():
  assert logits_chunk(8, 48, 2048, LOGITS_CHUNK_BYTES) is None  # the tiny/base benchmarks
  assert logits_chunk(8, 128, 65_536, LOGITS_CHUNK_BYTES) is None
  # Qwen: at most 55 steps' logits fit 256 MiB; 512 steps as 10 even chunks of 52, not 55
  assert logits_chunk(8, 512, 151_936, LOGITS_CHUNK_BYTES) == 52
  assert logits_chunk(8, 550, 151_936, LOGITS_CHUNK_BYTES) == 55  # 10 x 55 exactly
  for steps in range(56, 600, 7):  # fewest chunks that fit, and they waste < one step each
    chunk = logits_chunk(8, steps, 151_936, LOGITS_CHUNK_BYTES)
    n = -(-steps // chunk)
    assert chunk <= 55 and n == -(-steps // 55) and n * chunk - steps < n
  assert logits_chunk(8, 512, 151_936, None) is None
  assert logits_chunk(4, 10, 100, 1) == 1  # never below one step


def test_chunks_are_sized_by_the_rows_of_one_device():
  """On a mesh each device holds its share of the rows: 8 rows over data x fsdp = 4 are 2 per
  device, whose whole logits fit a limit that the 8 rows' would not (no chunk loop traced)."""
  from jax.sharding import AbstractMesh

  from jax_ppo.parallel.rules import gather_layers

  model = _model()
  v = model.config.vocab_size
  hidden = jnp.zeros((8, 6, model.config.hidden_size))
  tokens = jnp.zeros((8, 6), jnp.int32)
  limit = 2 * 6 * v * 4  # two rows' logits
  trace = lambda: str(jax.make_jaxpr(  # noqa: E731
      lambda h: head_logprobs(model, h, tokens, 1.0, chunk_bytes=limit))(hidden))
  assert logits_chunk(8, 6, v, limit) == 1 and "scan" in trace()  # one device: chunked
  with gather_layers(AbstractMesh((2, 2, 1), ("data", "fsdp", "tensor"))):
    assert "scan" not in trace()  # 2 rows per device: whole


def test_head_logprobs_chunked_equals_whole_with_gradients():
  model = _model()
  config = model.config
  graphdef, params = nnx.split(model)
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  hidden = jax.random.normal(k1, (3, 9, config.hidden_size))
  tokens = jax.random.randint(k2, (3, 9), 0, config.vocab_size)

  def loss(params, chunk_bytes):
    m = nnx.merge(graphdef, params)
    lp, ent = head_logprobs(m, hidden, tokens, 0.8, entropy="grad", chunk_bytes=chunk_bytes)
    return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)

  run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, want), want_g = run(params, None)
  one_step = 3 * config.vocab_size * 4
  assert logits_chunk(3, 9, config.vocab_size, 4 * one_step) == 3  # 3 even chunks, not 4 + 4 + 1
  (_, got), got_g = run(params, 4 * one_step)
  _close(got, want, "log-probs and entropies", rtol=1e-6)
  _close(got_g, want_g, "gradients")
