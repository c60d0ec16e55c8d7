"""`jax_ppo.parallel.host_rows` in one process (its multi-process behaviour is tested by
test_multiprocess_train.py): on a one-device mesh the per-process rollout path is the
single-process sampler, the row helpers are plain host round trips, and bad layouts get one
clear error."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jax_ppo.data.prompts import PromptDataset
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.transformer import CausalLM
from jax_ppo.parallel import MeshConfig, host_rows, make_mesh
from jax_ppo.ppo import prompt_shards
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler

MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(MeshConfig(), devices=jax.devices()[:1])


def test_row_helpers_on_one_process(mesh):
  host = np.arange(12, dtype=np.float32).reshape(6, 2)
  sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
  x = host_rows.global_rows(host, sharding, host.shape)
  assert not host_rows.is_global(x)
  assert host_rows.local_row_range(sharding, host.shape) == (0, 6)
  np.testing.assert_array_equal(host_rows.local_rows(x), host)
  np.testing.assert_array_equal(host_rows.gathered(x), host)
  assert host_rows.row_sharding(x).spec == PartitionSpec(("data", "fsdp"))
  assert host_rows.global_max(7) == 7
  with pytest.raises(ValueError, match=r"holds rows \[0, 6\) of a \(6, 2\) array but was given "
                                       r"\(5, 2\)"):
    host_rows.global_rows(host[:5], sharding, host.shape)


def test_prompt_shard_is_the_whole_batch_on_one_process(mesh):
  shard, sharding = prompt_shards.prompt_shard(mesh, 8)
  assert (shard.shard_index, shard.shard_count) == (0, 1)
  assert sharding.mesh == mesh


@pytest.mark.parametrize("n_samples", [1, 2])
def test_local_prompt_rollout_equals_the_sampler(mesh, n_samples):
  """The multi-process rollout path (each process's rows, padded to the batch's bucket, placed
  as rows of global arrays) gives the single-process sampler's rollout."""
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  config = SamplingConfig(max_new_tokens=4, temperature=1.0, stop_token_ids=(2,), pad_token_id=0,
                          n_samples=n_samples, batch_buckets=(4,), prompt_buckets=(4, 8))
  rng = np.random.default_rng(0)
  dataset = PromptDataset([list(rng.integers(3, 24, size=int(rng.integers(1, 7))))
                           for _ in range(10)], seed=3)
  sampler = Sampler(model, config, mesh=mesh)
  key = jax.random.PRNGKey(5)
  for position in (0, 2):  # (batch 2 wraps into the second epoch's permutation)
    expected = sampler(dataset.batch(position, 4)[0], key)
    rollout, texts = prompt_shards.sample_local_prompts(sampler, dataset, position, 4, key,
                                                    state=sampler.state)
    assert texts is None
    for name, value in vars(expected).items():
      np.testing.assert_array_equal(np.asarray(getattr(rollout, name)), np.asarray(value),
                                    err_msg=name)


def test_micro_batches_are_refused(mesh):
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  config = SamplingConfig(max_new_tokens=4, stop_token_ids=(2,), pad_token_id=0,
                          batch_buckets=(2, 4))
  sampler = Sampler(model, config, mesh=mesh, memory_budget_bytes=1)
  sampler.micro_batch_size = lambda num_prompts, length: 2  # a budget that holds 2 of 4 rows
  with pytest.raises(ValueError, match=r"micro-batches of 2 \(memory_budget_bytes\)"):
    prompt_shards.sample_local_prompts(sampler, PromptDataset([[3, 4]] * 4), 0, 4,
                                   jax.random.PRNGKey(0), state=sampler.state)


def test_a_sampler_without_a_mesh_is_refused():
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  sampler = Sampler(model, SamplingConfig(max_new_tokens=4, stop_token_ids=(2,), pad_token_id=0))
  with pytest.raises(ValueError, match=r"needs a sampler on a device mesh"):
    prompt_shards.sample_local_prompts(sampler, PromptDataset([[3, 4]] * 4), 0, 4,
                                   jax.random.PRNGKey(0), state=sampler.state)


def test_host_array_and_barrier_on_one_process():
  from jax_ppo.parallel.distributed import barrier, host_array

  x = jax.numpy.arange(6.0).reshape(2, 3)
  out = host_array(x)
  assert isinstance(out, np.ndarray)
  np.testing.assert_array_equal(out, np.arange(6.0).reshape(2, 3))
  np.testing.assert_array_equal(host_array([1, 2]), np.array([1, 2]))
  barrier("a barrier of one process returns at once")
