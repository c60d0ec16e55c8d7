"""The same tiny PPO update on one device, on a device mesh and over several processes.

A diagnostic for a cluster (`experiments/scale_check.py`) and the multi-process tests: a tiny
random Llama-shaped policy with a value head, one fixed synthetic rollout and fixed scores, then
one fused PPO update (`PPOSteps.experience_update`: experience, then `ppo_epochs` optimizer
steps). Run on one device it is the reference; run on a mesh (`PPOSteps(mesh=...)`: parameters
and optimizer state placed by the logical-axis rules of `jax_ppo.parallel.rules`, rollout rows
split over `data` x `fsdp`) the jitted update is the same SPMD program partitioned by XLA, so the
updated parameters must agree with the reference up to float summation order (the check uses
1e-4).

`run_processes` launches `num_processes` copies of this module (`python -m
jax_ppo.diagnostics.scale_check`), each with `devices_per_process` fake CPU devices
(`--xla_force_host_platform_device_count`), joined through `jax.distributed` over 127.0.0.1 with
gloo CPU collectives; every process builds the same inputs, the update runs on the global mesh
of all their devices, and process 0 writes the gathered parameters to a `.npz` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

DEFAULT_SIZE = {"batch_size": 8, "hidden_size": 16, "num_layers": 1, "max_new_tokens": 6,
                "ppo_epochs": 2}
"""The tiny update's default shape (`tiny_update`'s keyword arguments)."""


@dataclasses.dataclass(frozen=True)
class UpdateResult:
  """One run of the tiny update.

  Attributes:
    params: flattened updated trainable parameters, path -> float32 array (host copies).
    loss: the update's mean total loss (`loss/total_avg`).
    bytes_per_device: from the compiled program's memory analysis: arguments + outputs +
      temporaries - aliased bytes, per device (None when the backend gives no analysis).
    devices: number of devices the update ran on.
  """

  params: dict[str, np.ndarray]
  loss: float
  bytes_per_device: int | None
  devices: int


@dataclasses.dataclass(frozen=True)
class TinyUpdate:
  """The fixed inputs of the tiny update (host arrays, identical in every process)."""

  make_steps: Callable[[Any], Any]
  """`mesh -> PPOSteps` of the tiny policy (None: one device)."""
  state: Any
  """Its `TrainState` at step 0."""
  frozen: Any
  """Its `FrozenParams` (the reference policy)."""
  rollout: Any
  """A synthetic `Rollout` of `batch_size` rows."""
  scores: np.ndarray
  """`[batch_size]` float32 reward scores."""


def tiny_update(*, batch_size: int = 8, hidden_size: int = 16, num_layers: int = 1,
                max_new_tokens: int = 6, ppo_epochs: int = 2, seed: int = 0) -> TinyUpdate:
  """A tiny random Llama-shaped policy with a value head (GAE), and a fixed synthetic rollout.

  The rollout is drawn with NumPy from `seed` (left-padded prompts of 2-5 tokens, responses of
  1 to `max_new_tokens` tokens, some ending in the stop token), so every process builds the same
  one without running the sampler; the old and reference log-probs are recomputed by the
  update's experience phase anyway.
  """
  from flax import nnx

  from jax_ppo.models.config import ModelConfig
  from jax_ppo.models.transformer import CausalLM
  from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling
  from jax_ppo.ppo.state import FrozenParams, init_train_state
  from jax_ppo.ppo.steps import PPOSteps
  from jax_ppo.rollout.sampler import Rollout
  from jax_ppo.training.optim import make_optimizer

  if hidden_size % 8 or hidden_size < 8:
    raise ValueError(f"hidden_size={hidden_size} must be a positive multiple of 8 (head_dim 8).")
  stop, pad, prompt_len = 2, 0, 5
  model = ModelConfig(
      model_type="llama", vocab_size=32, hidden_size=hidden_size,
      intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=hidden_size // 8,
      num_kv_heads=max(1, hidden_size // 16), head_dim=8,
      max_position_embeddings=prompt_len + max_new_tokens + 8,
  )
  config = PPOConfig(
      batch_size=batch_size, num_minibatches=1, ppo_epochs=ppo_epochs,
      sampling=PPOSampling(max_new_tokens=max_new_tokens, temperature=1.0,
                           stop_token_ids=(stop,), pad_token_id=pad),
      optimizer=PPOOptimizer(learning_rate=3e-3, lr_schedule="constant"), kl_coef=0.05,
      vf_coef=0.5, total_updates=4, reward_clip=None,
      seed=seed,
  )
  policy = CausalLM(model, rngs=nnx.Rngs(seed))
  policy.add_value_head()
  graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
  optimizer, schedule = make_optimizer(config.optimizer, config.total_optimizer_steps)
  make_steps = functools.partial(
      PPOSteps, config, policy_graphdef=graphdef, value_graphdef=None, shared_value_head=True,
      lora=False, optimizer=optimizer, schedule=schedule)
  state = init_train_state(config, optimizer, policy=params, value=None,
                           rng=jax.random.PRNGKey(seed))
  frozen = FrozenParams(policy_rest=rest, ref=jax.tree.map(np.array, params), value_rest=None,
                        reward=None)

  rng = np.random.default_rng(seed)
  b, t = batch_size, max_new_tokens
  prompt_lens = rng.integers(2, prompt_len + 1, size=b)
  prompt_mask = (np.arange(prompt_len)[None] >= prompt_len - prompt_lens[:, None]).astype(np.int32)
  prompt_ids = np.where(prompt_mask, rng.integers(3, model.vocab_size, size=(b, prompt_len)), pad)
  lengths = rng.integers(1, t + 1, size=b)
  response_mask = np.arange(t)[None] < lengths[:, None]
  has_stop = rng.random(b) < 0.5
  response_ids = rng.integers(3, model.vocab_size, size=(b, t))
  response_ids[np.arange(b), lengths - 1] = np.where(has_stop, stop,
                                                     response_ids[np.arange(b), lengths - 1])
  response_ids = np.where(response_mask, response_ids, pad)
  mask = np.concatenate([prompt_mask, response_mask.astype(np.int32)], axis=1)
  rollout = Rollout(
      prompt_ids=prompt_ids.astype(np.int32), prompt_mask=prompt_mask,
      response_ids=response_ids.astype(np.int32), response_mask=response_mask,
      logprobs=np.zeros((b, t), np.float32),
      positions=np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32),
      has_stop=has_stop,
  )
  scores = np.sum(response_ids == 7, axis=1).astype(np.float32) + rng.normal(size=b).astype(
      np.float32)
  return TinyUpdate(make_steps=lambda mesh: make_steps(mesh=mesh), state=jax.device_get(state),
                    frozen=jax.device_get(frozen), rollout=rollout, scores=scores)


def _flat(tree: Any) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {jax.tree_util.keystr(p): np.asarray(x, np.float32) for p, x in leaves}


def _to_host(tree: Any) -> Any:
  """Host copies of (possibly multi-process, sharded) arrays."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)


def _place(tree: Any, shardings: Any) -> Any:
  """Global arrays of `tree`'s host values (identical on every process) with `shardings` (each
  process fills only its own devices' shards)."""
  def place(x, sharding):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(place, tree, shardings)


def run_update(tiny: TinyUpdate, *, mesh: jax.sharding.Mesh | None = None) -> UpdateResult:
  """One fused PPO update of `tiny.state` on its rollout and scores.

  Args:
    tiny: from `tiny_update`.
    mesh: None: one device (the first local one). Otherwise a mesh of
      `jax_ppo.parallel.make_mesh` (it may span several processes): the update is
      `PPOSteps(mesh=mesh).experience_update`, its inputs placed by the same rules.
  """
  from jax_ppo.parallel import rules

  steps = tiny.make_steps(mesh)
  args = (tiny.state, tiny.frozen, tiny.rollout, tiny.scores)
  if mesh is None:
    state, frozen, *inputs = jax.device_put(args, jax.local_devices()[0])
    n = 1
  else:
    state, frozen, *inputs = (
        _place(tiny.state, rules.param_shardings(tiny.state, mesh)),
        _place(tiny.frozen, rules.param_shardings(tiny.frozen, mesh)),
        _place(tiny.rollout, rules.batch_shardings(tiny.rollout, mesh)),
        _place(tiny.scores, rules.batch_shardings(tiny.scores, mesh)),
    )
    n = mesh.size
  compiled = steps.experience_update.lower(state, frozen, *inputs).compile()
  state, _, _, metrics = compiled(state, frozen, *inputs)
  params, loss = _to_host((state.params, metrics["loss/total_avg"]))
  return UpdateResult(params=_flat(params), loss=float(loss),
                      bytes_per_device=_bytes_per_device(compiled), devices=n)


def _bytes_per_device(compiled: Any) -> int | None:
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends have no analysis
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def max_param_diff(a: UpdateResult, b: UpdateResult) -> float:
  """Largest absolute difference between the updated parameters of two runs."""
  if a.params.keys() != b.params.keys():
    raise ValueError(f"The runs updated different parameters: {sorted(a.params)} vs "
                     f"{sorted(b.params)}.")
  return max(float(np.max(np.abs(a.params[k] - b.params[k]))) for k in a.params)


def free_port() -> int:
  """A free TCP port on 127.0.0.1 (for the coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(num_processes: int = 2, devices_per_process: int = 4, *,
                  timeout: float = 120.0, size: dict[str, int] | None = None,
                  mesh: str = "data=-1") -> UpdateResult:
  """The tiny update over `num_processes` local processes joined by `jax.distributed`.

  Args:
    num_processes, devices_per_process: the job's shape (fake CPU devices).
    timeout: seconds before the processes are killed (a `TimeoutError` with their output).
    size: `tiny_update` keyword arguments (default `DEFAULT_SIZE`).
    mesh: sizes of the global mesh's axes, "data=2,fsdp=2,tensor=2" (default: data parallel
      over every device; -1 takes the rest).

  Returns:
    Process 0's `UpdateResult` (parameters gathered from every process).
  """
  import subprocess  # the one launcher in the package (tests/test_security.py allows it here)

  size = {**DEFAULT_SIZE, **(size or {})}
  port = free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                      f"{devices_per_process}").strip()
  env["JAX_PLATFORMS"] = "cpu"
  root = str(pathlib.Path(__file__).resolve().parents[2])
  env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "result.npz"
    procs, logs = [], []
    for i in range(num_processes):
      log = open(pathlib.Path(tmp) / f"process{i}.log", "w+", encoding="utf-8")  # noqa: SIM115
      logs.append(log)
      args = [sys.executable, "-m", "jax_ppo.diagnostics.scale_check", "--coordinator",
              f"127.0.0.1:{port}", "--num-processes", str(num_processes), "--process-id",
              str(i), "--out", str(out), "--mesh", mesh,
              *[f"--{k.replace('_', '-')}={v}" for k, v in size.items()]]
      procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
      for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise TimeoutError(f"The {num_processes} processes did not finish in {timeout} s:\n"
                         + _outputs(logs)) from None
    finally:
      for p in procs:
        p.wait()
    if any(p.returncode for p in procs) or not out.is_file():
      raise RuntimeError(f"A process failed (exit codes {[p.returncode for p in procs]}):\n"
                         + _outputs(logs))
    for log in logs:
      log.close()
    with np.load(out) as data:
      params = {k.removeprefix("param:"): data[k] for k in data.files if k.startswith("param:")}
      nbytes = int(data["bytes_per_device"])
      return UpdateResult(params=params, loss=float(data["loss"]),
                          bytes_per_device=None if nbytes < 0 else nbytes,
                          devices=int(data["devices"]))


def _outputs(logs: list) -> str:
  text = []
  for i, log in enumerate(logs):
    log.flush()
    log.seek(0)
    text.append(f"--- process {i} ---\n{log.read()[-4000:]}")
    log.close()
  return "\n".join(text)


def parse_mesh(text: str) -> Any:
  """"data=2,fsdp=2,tensor=2" -> `MeshConfig(data=2, fsdp=2, tensor=2)` (-1: the rest)."""
  from jax_ppo.parallel.mesh import MeshConfig

  sizes = {}
  for part in filter(None, text.split(",")):
    name, _, value = part.partition("=")
    try:
      sizes[name.strip()] = int(value)
    except ValueError:
      raise ValueError(f"Mesh axis {part!r} is not name=size (e.g. data=2,fsdp=-1).") from None
  unknown = set(sizes) - {"data", "fsdp", "tensor"}
  if unknown or not sizes:
    raise ValueError(f"Mesh {text!r}: give sizes of data, fsdp and tensor, e.g. "
                     "data=2,fsdp=2,tensor=2.")
  return MeshConfig(**{"data": 1, **sizes})


def _worker(argv: Sequence[str] | None = None) -> None:
  """One process of `run_processes`."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--mesh", default="data=-1")  # MeshConfig sizes
  for key in DEFAULT_SIZE:
    parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=DEFAULT_SIZE[key])
  args = parser.parse_args(argv)
  from jax_ppo.parallel.distributed import DistributedConfig, initialize

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  initialize(DistributedConfig(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=60))
  tiny = tiny_update(**{k: getattr(args, k) for k in DEFAULT_SIZE})
  from jax_ppo.parallel.mesh import make_mesh

  result = run_update(tiny, mesh=make_mesh(parse_mesh(args.mesh)))
  if jax.process_index() == 0:
    np.savez(args.out, loss=result.loss, devices=result.devices,
             bytes_per_device=-1 if result.bytes_per_device is None else result.bytes_per_device,
             **{f"param:{k}": v for k, v in result.params.items()})
  jax.distributed.shutdown()


if __name__ == "__main__":
  _worker()
