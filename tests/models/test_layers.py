"""Building blocks of `jax_ppo.models.layers`: the scalar head of reward and value models."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.layers import ScalarHead


def test_head_initialisations():
  d = 4095
  reward = ScalarHead(d, init="reward", rngs=nnx.Rngs(0))
  std = float(jnp.std(reward.kernel[...]))
  assert abs(std - 1 / np.sqrt(d + 1)) < 0.05 / np.sqrt(d + 1)
  assert float(jnp.abs(reward.bias[...]).max()) == 0
  value = ScalarHead(d, init="zeros", rngs=nnx.Rngs(0))
  assert float(jnp.abs(value.kernel[...]).max()) == 0
  with pytest.raises(ValueError, match="init"):
    ScalarHead(d, init="ones", rngs=nnx.Rngs(0))
