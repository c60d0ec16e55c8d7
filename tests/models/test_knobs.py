"""Performance knobs change speed and memory, never values: remat policies and unrolled layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from jax_ppo.core import gather_logprobs
from tests.models.conftest import left_padded_batch

pytest.importorskip("torch", reason="the tiny checkpoints are built with transformers' PyTorch")


def _loss_and_grads(model, ids, mask):
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state):
    def loss(state):
      logits = nnx.merge(graphdef, state)(ids[:, :-1], attention_mask=mask[:, :-1])
      lp = gather_logprobs(logits, ids[:, 1:])
      return -jnp.sum(lp * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    return jax.value_and_grad(loss)(state)

  return run(state)


def test_gradients_do_not_depend_on_remat_or_unrolling(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  ids, mask = left_padded_batch()
  loss0, grads0 = _loss_and_grads(models.from_pretrained(path), ids, mask)
  assert float(jnp.abs(grads0["decoder"]["layers"]["q"]["kernel"][...]).max()) > 0
  for kwargs in (dict(remat="dots"), dict(remat="layer", scan_layers=False)):
    loss1, grads1 = _loss_and_grads(models.from_pretrained(path, **kwargs), ids, mask)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    for g0, g1 in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1), strict=True):
      np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), atol=1e-6, rtol=1e-5,
                                 err_msg=str(kwargs))


def test_bad_remat_policy_is_rejected(hf_checkpoint):
  _, path = hf_checkpoint("qwen3")
  with pytest.raises(ValueError, match="remat"):
    models.from_pretrained(path, remat="sometimes")
