"""Per-device memory of one PPO update of Qwen3-0.6B and Llama-3.2-1B shapes: FSDP vs replicated.

No weights are needed: `jax_ppo.diagnostics.memory.update_memory` compiles `PPOSteps.update` for
abstract arrays carrying their shardings and reads the compiled program's memory analysis
(parameters and optimizer state per device from its input shardings; "temp" is
`temp_size_in_bytes`, XLA's scratch while the update runs: activations, gradients and the
optimizer's temporaries). Two layouts on the same devices: `data=N` (plain data parallelism, every
device holds the whole model) and `fsdp=N` (parameters and Adam moments split N ways). The
batch is split N ways in both, so activations differ only by what FSDP gathers.

Runs on fake CPU devices when there is no accelerator (the script sets
`--xla_force_host_platform_device_count`):

    python experiments/benchmarks/sharding_memory.py --json results/sharding_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8, help="mesh size (fake CPU devices on CPU)")
  p.add_argument("--batch", type=int, default=8, help="rows per update (batch_size)")
  p.add_argument("--prompt", type=int, default=128, help="prompt slots per row")
  p.add_argument("--response", type=int, default=128, help="response slots (max_new_tokens)")
  p.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b")
  p.add_argument("--json", help="write the results here")
  return p.parse_args(argv)


def model_configs():
  from jax_ppo.models.config import ModelConfig, RopeScaling

  return {
      "qwen3-0.6b": ModelConfig(
          model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
          num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
          max_position_embeddings=40960, rope_theta=1e6, qk_norm=True, tie_word_embeddings=True,
      ),
      "llama-3.2-1b": ModelConfig(
          model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
          num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
          max_position_embeddings=131072, rope_theta=500000.0, norm_eps=1e-5,
          rope_scaling=RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192),
          tie_word_embeddings=True,
      ),
  }


def gib(n: int) -> str:
  return f"{n / 2**30:.3f}"


def main(argv=None) -> int:
  args = parse_args(argv)
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={args.devices}").strip()
  import jax

  from jax_ppo.diagnostics.memory import update_memory
  from jax_ppo.parallel import MeshConfig, make_mesh
  from jax_ppo.ppo import PPOConfig, PPOSampling

  devices = jax.devices()[: args.devices]
  if len(devices) < args.devices:
    print(f"Only {len(devices)} devices; pass --devices {len(devices)}.", file=sys.stderr)
    return 2
  ppo = PPOConfig(batch_size=args.batch, sampling=PPOSampling(max_new_tokens=args.response),
                  ppo_epochs=1)
  configs = model_configs()
  results = {"devices": args.devices, "platform": devices[0].platform, "batch": args.batch,
             "prompt": args.prompt, "response": args.response, "models": {},
             "host": host_record()}
  layouts = {"replicated": MeshConfig(data=args.devices), "fsdp": MeshConfig(data=1, fsdp=-1)}
  rows = []
  for name in args.models.split(","):
    per_layout = {}
    for layout, mesh_config in layouts.items():
      t0 = time.perf_counter()
      mem = update_memory(configs[name], ppo, make_mesh(mesh_config, devices=devices),
                          prompt_length=args.prompt)
      mem["compile_s"] = round(time.perf_counter() - t0, 1)
      per_layout[layout] = mem
      rows.append((name, layout, mem))
    rep, fsdp = per_layout["replicated"], per_layout["fsdp"]
    per_layout["param_ratio"] = rep["params"] / fsdp["params"]
    per_layout["optimizer_ratio"] = rep["optimizer"] / fsdp["optimizer"]
    results["models"][name] = per_layout

  print(f"Per-device GiB of one PPO update ({args.devices} {results['platform']} devices, batch "
        f"{args.batch} x ({args.prompt} + {args.response}) tokens, fp32, AdamW, value head):")
  print(host_line(results["host"]))
  header = ("model", "layout", "params", "reference", "optimizer", "temp", "arguments")
  print(" | ".join(f"{h:>12}" for h in header))
  for name, layout, m in rows:
    print(" | ".join(f"{v:>12}" for v in (name, layout, gib(m["params"]), gib(m["reference"]),
                                          gib(m["optimizer"]), gib(m["activations"]),
                                          gib(m["arguments"]))))
  for name, r in results["models"].items():
    print(f"{name}: FSDP cuts parameters {r['param_ratio']:.2f}x, optimizer state "
          f"{r['optimizer_ratio']:.2f}x")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
