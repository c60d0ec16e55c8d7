"""The tensor-parallel rollout (`SamplingConfig.decode_tensor`, `jax_ppo.parallel.decode_mesh`):
on an FSDP mesh of 8 fake CPU devices the rollout regrouped `(n/k, 1, k)` draws the tokens and
log-probs of the single-device sampler, with each weight matrix split on its heads, MLP or
vocabulary dimension and far fewer all-gathers, and a PPO trainer's updates are unchanged.

The mesh cases run in a subprocess (`scripts/decode_tensor.py`, `tests/parallel/multidevice.py`):
the pytest process has one device.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models import compute_weights
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.transformer import CausalLM
from jax_ppo.parallel import MeshConfig, decode_mesh, make_mesh
from jax_ppo.ppo import PPOSampling
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler
from tests.parallel.multidevice import run_on_devices

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "decode_tensor.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def result():
  return run_on_devices(SCRIPT, timeout=600)


@pytest.mark.slow
def test_the_tensor_parallel_rollout_draws_the_single_device_tokens(result):
  cases = result["cases"]
  assert set(cases) == {f"{mode}/{layout}" for mode in ("greedy", "sampled")
                        for layout in ("fsdp", "decode_tensor=1", "decode_tensor=2",
                                       "decode_tensor=4")} | {"lora/decode_tensor=4"}
  for name, case in cases.items():
    assert case["tokens_equal"] and case["mask_equal"], name
    assert case["logprob_diff"] < TOL, name


@pytest.mark.slow
def test_the_rollout_mesh_splits_the_matrices_on_heads(result):
  assert result["devices"] == 8
  assert result["decode_mesh"] == {"data": 2, "fsdp": 1, "tensor": 4}
  assert result["same_devices"]
  # The query kernel `[L, D, H * Dh]` = [2, 32, 32]: split on its heads over 4 devices in the
  # rollout, on its model width over 8 in training.
  assert result["q_spec"] == "P(None, None, 'tensor')" and result["q_shard_shape"] == [2, 32, 8]
  assert "fsdp" in result["trained_q_spec"]
  # Neither layout gathers a weight matrix in the decode step: FSDP's stay split on their width
  # (`rules.stationary_layer_weights`), the tensor-parallel ones on their heads, MLP or
  # vocabulary.
  matrices = {tuple(s) for s in result["layer_matrix_shapes"]}
  assert matrices == {(32, 16), (32, 32), (32, 64), (64, 32)}
  assert result["decode_step_gathers"]["fsdp"]  # FSDP's step gathers some activations
  for layout, gathered in result["decode_step_gathers"].items():
    squeezed = {tuple(d for d in shape if d != 1) for shape in gathered}
    assert not squeezed & matrices, (layout, gathered)
  assert result["bf16_dtypes"] == {"q_kernel": "bfloat16", "norm_scale": "float32",
                                   "embedding": "bfloat16"}


@pytest.mark.slow
def test_a_width_that_does_not_divide_the_kv_heads_is_one_clear_error(result):
  for k in ("3", "8", "16"):
    message = result["errors"][k]
    assert message.startswith(f"SamplingConfig.decode_tensor={k} ")
    assert "4 key/value heads" in message and "[1, 2, 4]" in message


@pytest.mark.slow
def test_ppo_updates_are_those_of_the_rollout_on_the_training_mesh(result):
  runs = result["trainer"]
  assert runs["training_mesh"]["sampler_mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  assert runs["decode_tensor=2"]["sampler_mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}
  base, tp = runs["training_mesh"]["metrics"], runs["decode_tensor=2"]["metrics"]
  assert len(base) == len(tp) == 2
  for a, b in zip(base, tp, strict=True):
    assert a.keys() == b.keys() and "loss/total_avg" in a
    for k in a:
      assert abs(a[k] - b[k]) < TOL, k
  assert base[0]["loss/total_avg"] != 0.0  # a real update
  assert runs["max_param_diff"] < TOL


def test_decode_tensor_is_checked_where_it_is_set():
  for bad in (0, -2, 1.5, True, "2"):
    with pytest.raises(ValueError, match=r"SamplingConfig\.decode_tensor="):
      SamplingConfig(decode_tensor=bad)
  with pytest.raises(ValueError, match=r"PPOConfig\.sampling\.decode_tensor="):
    PPOSampling(decode_tensor=0)
  assert SamplingConfig.from_params(PPOSampling(decode_tensor=4)).decode_tensor == 4


def test_decode_mesh_of_one_device_and_a_width_that_does_not_divide():
  mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
  assert dict(decode_mesh(mesh, 1).shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match="decode_tensor=2 does not divide the mesh's 1 devices"):
    decode_mesh(mesh, 2)


def _bf16_model() -> CausalLM:
  config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=64)
  model = CausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  leaves = [0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x + 0.1
            for k, x in zip(keys, leaves, strict=True)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def test_compute_weights_casts_what_the_layers_cast_and_changes_no_token():
  """The rollout of a bfloat16-compute model on its cast weights is bit for bit the rollout on
  its float32 masters; norm scales stay float32."""
  model = _bf16_model()
  state = nnx.state(model)
  cast = compute_weights(state, jnp.bfloat16)
  layers = cast["decoder"]["layers"]
  assert layers["q"]["kernel"].dtype == jnp.bfloat16
  assert cast["decoder"]["embed"]["embedding"].dtype == jnp.bfloat16
  assert layers["attn_norm"]["scale"].dtype == jnp.float32
  assert cast["decoder"]["final_norm"]["scale"].dtype == jnp.float32
  config = SamplingConfig(max_new_tokens=8, n_samples=2, temperature=1.0, pad_token_id=0)
  sampler = Sampler(model, config)
  prompts, key = [[5, 6, 7], [8, 9], [4]], jax.random.key(2)
  a, b = sampler(prompts, key, state=state), sampler(prompts, key, state=cast)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
