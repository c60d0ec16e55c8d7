"""Peak memory of one PPO update at a Qwen3-0.6B shape, from the compiled program's memory
analysis: whole `[B, T, V]` logits against the chunked log-prob/entropy path.

No weights are loaded and nothing runs: the model, the train state and the rollout are abstract
(`nnx.eval_shape`, `jax.eval_shape`, `jax.ShapeDtypeStruct`), and the trainer's fused
`PPOSteps.experience_update` (old log-probs and values from the first epoch's forward pass,
reference log-probs, GAE, `--epochs` PPO epochs with AdamW; the program a run with one
minibatch executes) is lowered and compiled for the local backend. XLA's `memory_analysis()`
gives the bytes of the arguments, the outputs, the aliased (donated) buffers and the temporaries;
the peak estimate is `arguments + outputs - aliased + temporaries`.

Shape (`--shape qwen3-0.6b`): vocab 151,936, width 1024, 28 layers, 16 query / 8 KV heads of 128,
MLP 3072, tied embeddings, QK-norm; batch 8 of 512 prompt + 512 response tokens (sequence 1024);
policy with a value head on its trunk (GAE), fp32 weights and compute. `--shape small` is a
2-layer model of the same vocabulary for a quick check.

    python experiments/benchmarks/update_memory.py [--shape qwen3-0.6b|small] [--remat full]
        [--dtype bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(model=dict(
        model_type="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40_960,
        rope_theta=1_000_000.0, qk_norm=True, tie_word_embeddings=True,
    ), batch=8, prompt=512, response=512),
    "small": dict(model=dict(
        model_type="qwen3", vocab_size=151_936, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
        qk_norm=True, tie_word_embeddings=True,
    ), batch=4, prompt=128, response=128),
}
GIB = 2**30


def abstract_update(shape: dict, *, epochs: int, dtype: str, remat: str = "none"):
  """`(steps, args)`: the `PPOSteps` of the shape's run and abstract arguments of
  `experience_update`."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jax_ppo.models.config import ModelConfig
  from jax_ppo.models.transformer import CausalLM
  from jax_ppo.ppo.config import PPOConfig, PPOOptimizer, PPOSampling
  from jax_ppo.ppo.state import FrozenParams, init_train_state
  from jax_ppo.ppo.steps import PPOSteps
  from jax_ppo.rollout.sampler import Rollout
  from jax_ppo.training.optim import make_optimizer

  b, s, t = shape["batch"], shape["prompt"], shape["response"]
  config = PPOConfig(
      batch_size=b, num_minibatches=1, ppo_epochs=epochs,
      sampling=PPOSampling(max_new_tokens=t, stop_token_ids=(2,), pad_token_id=0),
      total_updates=10, optimizer=PPOOptimizer(lr_schedule="constant"),
  )
  compute = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]

  def build():
    model = CausalLM(ModelConfig(**shape["model"]), dtype=compute, param_dtype=jnp.float32,
                     remat=remat, rngs=nnx.Rngs(0))
    model.add_value_head()
    return model

  policy = nnx.eval_shape(build)
  graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
  optimizer, schedule = make_optimizer(config.optimizer, config.total_optimizer_steps)
  steps = PPOSteps(config, policy_graphdef=graphdef, value_graphdef=None, shared_value_head=True,
                   lora=False, optimizer=optimizer, schedule=schedule)
  state = jax.eval_shape(
      lambda p: init_train_state(config, optimizer, policy=p, value=None,
                                 rng=jax.random.PRNGKey(0)), params)
  frozen = FrozenParams(policy_rest=rest, ref=params, value_rest=None, reward=None)
  sds = jax.ShapeDtypeStruct
  rollout = Rollout(
      prompt_ids=sds((b, s), jnp.int32), prompt_mask=sds((b, s), jnp.int32),
      response_ids=sds((b, t), jnp.int32), response_mask=sds((b, t), jnp.bool_),
      logprobs=sds((b, t), jnp.float32), positions=sds((b, s + t), jnp.int32),
      has_stop=sds((b,), jnp.bool_),
  )
  return steps, (state, frozen, rollout, sds((b,), jnp.float32))


def measure(shape: dict, *, chunk_bytes: int | None, epochs: int, dtype: str,
            remat: str = "none") -> dict:
  """Compiles `experience_update` with `logits_chunk_bytes=chunk_bytes`; its memory analysis."""
  steps, args = abstract_update(shape, epochs=epochs, dtype=dtype, remat=remat)
  steps.logits_chunk_bytes = chunk_bytes
  start = time.perf_counter()
  compiled = steps.experience_update.lower(*args).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  out = {
      "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
      "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
  }
  out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
  b, t, v = shape["batch"], shape["response"], shape["model"]["vocab_size"]
  out["chunk_steps"] = _chunk(b, t, v, chunk_bytes)
  out["compile_s"] = round(seconds, 1)
  return out


def _chunk(b, t, v, limit):
  from jax_ppo.models.logprobs import logits_chunk

  return logits_chunk(b, t, v, limit)


def main(argv=None) -> dict:
  from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
  p.add_argument("--epochs", type=int, default=1, help="PPO epochs in the program (default 1)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--chunk-bytes", type=int, default=LOGITS_CHUNK_BYTES,
                 help="PPOSteps.logits_chunk_bytes of the chunked run (default 256 MiB)")
  p.add_argument("--remat", default="none",
                 help="per-layer rematerialisation of both runs (RunConfig.remat; default none)")
  p.add_argument("--json", help="write the results to this JSON file")
  args = p.parse_args(argv)
  import jax

  shape = SHAPES[args.shape]
  runs = {
      "whole logits (before)": measure(shape, chunk_bytes=None, epochs=args.epochs,
                                       dtype=args.dtype, remat=args.remat),
      "chunked (after)": measure(shape, chunk_bytes=args.chunk_bytes, epochs=args.epochs,
                                 dtype=args.dtype, remat=args.remat),
  }
  result = {
      "benchmark": "update_memory", "shape": args.shape, "config": shape, "epochs": args.epochs,
      "dtype": args.dtype, "remat": args.remat, "program": "PPOSteps.experience_update",
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
      "jax": jax.__version__, "runs": runs, "host": host_record(),
  }
  names = ("arguments", "outputs", "aliased", "temporaries", "peak")
  print(f"{args.shape}: batch {shape['batch']}, {shape['prompt']} + {shape['response']} tokens, "
        f"vocab {shape['model']['vocab_size']}, {args.dtype}, remat {args.remat}, "
        f"{args.epochs} epoch(s), "
        f"{result['backend']} ({result['device_kind']}); {host_line(result['host'])}")
  print(f"| GiB | {' | '.join(names)} | chunk steps | compile s |")
  print("|---" * (len(names) + 3) + "|")
  for name, r in runs.items():
    cells = " | ".join(f"{r[k] / GIB:.2f}" for k in names)
    print(f"| {name} | {cells} | {r['chunk_steps'] or '-'} | {r['compile_s']} |")
  before, after = runs["whole logits (before)"], runs["chunked (after)"]
  print(f"peak: {before['peak'] / GIB:.2f} -> {after['peak'] / GIB:.2f} GiB "
        f"({after['peak'] / before['peak']:.2f}x)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
