"""Forward and training-step throughput of jax_ppo.models against Hugging Face PyTorch on CPU.

For each model shape (random weights, fp32) it times, on one batch of `--batch` x `--seq` tokens:
- forward: the mean next-token cross-entropy (logits + log-softmax), no gradient;
- train: the same loss with its gradient w.r.t. every parameter (forward + backward);
for the JAX model (one jitted function each) and for the same architecture in PyTorch
(`transformers.AutoModelForCausalLM.from_config`, same config, eager, `torch.no_grad` for the
forward). Achieved GFLOP/s use `2 N T` (forward) and `6 N T` (train) with `T` tokens and `N` the
parameters that take part in matmuls (every weight but the input/position embedding lookups; a
tied embedding counts once, as the output projection); attention's `S^2` terms are not counted.
The fp32 matmul peak is measured in the same run (`jnp.dot` / `torch.mm` of large square
matrices), and the table prints each throughput as a fraction of it, twice: per wall-clock second
and per CPU-second of the process (all threads). On a host shared with other jobs the wall-clock
figures swing with the load; the CPU-second figures measure the work done per core-second and
are far more stable, so both are reported.

    python experiments/benchmarks/forward.py --json /tmp/forward.json
    python experiments/benchmarks/forward.py --shape gpt2-small --batch 4 --seq 256

XLA CPU flags are set with `--xla-flags` before jax is imported (default: the preset that
measured best on this machine, see the module constant). Timings on a shared host are noisy:
compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402
from rss import peak_rss_mib  # noqa: E402

#: XLA flags applied unless --xla-flags overrides them (see the report in the models issue).
DEFAULT_XLA_FLAGS = ""

SHAPES = {
    # GPT-2 small: 124M parameters, tied embedding, learned positions.
    "gpt2-small": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                                vocab_size=50257)),
    # Qwen3-0.6B: 28 layers, D 1024, 16 query / 8 kv heads of 128, F 3072, tied 151936 vocab.
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 vocab_size=151936, max_position_embeddings=4096,
                                 tie_word_embeddings=True)),
    # A small shape for smoke runs.
    "tiny": ("llama", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                           max_position_embeddings=512, tie_word_embeddings=False)),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", nargs="+", default=["gpt2-small", "qwen3-0.6b"], choices=list(SHAPES))
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
  p.add_argument("--remat", default="none", choices=["none", "layer", "dots", "dots_all"])
  p.add_argument("--unroll", action="store_true", help="unrolled layers instead of lax.scan")
  p.add_argument("--xla-flags", default=None, help="XLA_FLAGS for this run (default: preset)")
  p.add_argument("--matmul-size", type=int, default=2048)
  p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
  p.add_argument("--json", default=None, help="write the results to this path")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="compute dtype of the jax model (weights stay float32)")
  return p.parse_args(argv)


def _median_time(fn, reps):
  """Median wall-clock seconds and median process CPU seconds (all threads) of `fn()`."""
  fn()  # Warm-up (and compilation).
  wall, cpu = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return sorted(wall)[reps // 2], sorted(cpu)[reps // 2]


def matmul_peak_jax(n, reps):
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  wall, cpu = _median_time(lambda: dot(a, b).block_until_ready(), max(reps, 5))
  return 2 * n**3 / wall / 1e9, 2 * n**3 / cpu / 1e9


def matmul_peak_torch(n, reps):
  import torch

  a, b = torch.randn(n, n), torch.randn(n, n)
  wall, cpu = _median_time(lambda: torch.mm(a, b), max(reps, 5))
  return 2 * n**3 / wall / 1e9, 2 * n**3 / cpu / 1e9


def hf_config(shape):
  import transformers

  model_type, kwargs = SHAPES[shape]
  cls = transformers.CONFIG_MAPPING[model_type]
  extra = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if model_type == "gpt2" else {}
  return cls(**kwargs, **extra)


def matmul_params(config) -> int:
  """Parameters used in matmuls: every weight except the embedding lookups (see module doc)."""
  c = config
  d, f = c.hidden_size, c.intermediate_size
  per_layer = d * (c.q_size + 2 * c.kv_size) + c.q_size * d + (3 if c.gated_mlp else 2) * d * f
  return c.num_layers * per_layer + d * c.vocab_size


def bench_jax(config, args):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jax_ppo.core import gather_logprobs
  from jax_ppo.models import CausalLM

  model = CausalLM(config, remat=args.remat, scan_layers=not args.unroll,
                   dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  del model
  rng = jax.random.key(1)
  ids = jax.random.randint(rng, (args.batch, args.seq + 1), 0, config.vocab_size)
  mask = jnp.ones((args.batch, args.seq), jnp.int32)

  def loss_fn(params, ids):
    logits = nnx.merge(graphdef, params)(ids[:, :-1], attention_mask=mask)
    return -jnp.mean(gather_logprobs(logits, ids[:, 1:]))

  fwd = jax.jit(loss_fn)
  train = jax.jit(jax.value_and_grad(loss_fn))
  t0 = time.perf_counter()
  jax.block_until_ready(fwd(params, ids))
  compile_fwd = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(train(params, ids))
  compile_train = time.perf_counter() - t0
  t_fwd, c_fwd = _median_time(lambda: jax.block_until_ready(fwd(params, ids)), args.reps)
  t_train, c_train = _median_time(lambda: jax.block_until_ready(train(params, ids)), args.reps)
  return dict(forward_s=t_fwd, train_s=t_train, forward_cpu_s=c_fwd, train_cpu_s=c_train,
              first_call_forward_s=compile_fwd, first_call_train_s=compile_train)


def bench_torch(hf_cfg, args):
  import torch
  import torch.nn.functional as F
  import transformers

  torch.manual_seed(0)
  hf_cfg._attn_implementation = "sdpa"
  model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
  model.train()  # Dropout is 0 in these configs; train() only enables autograd bookkeeping.
  ids = torch.randint(0, hf_cfg.vocab_size, (args.batch, args.seq + 1))
  mask = torch.ones(args.batch, args.seq, dtype=torch.long)

  def loss():
    logits = model(input_ids=ids[:, :-1], attention_mask=mask).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

  def fwd():
    with torch.no_grad():
      loss()

  def train():
    model.zero_grad(set_to_none=True)
    loss().backward()

  t_fwd, c_fwd = _median_time(fwd, args.reps)
  t_train, c_train = _median_time(train, args.reps)
  return dict(forward_s=t_fwd, train_s=t_train, forward_cpu_s=c_fwd, train_cpu_s=c_train)


def main(argv=None):
  args = parse_args(argv)
  flags = DEFAULT_XLA_FLAGS if args.xla_flags is None else args.xla_flags
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
  import device_peaks
  import jax

  from jax_ppo.models.config import config_from_hf

  tokens = args.batch * args.seq
  results = dict(
      xla_flags=os.environ["XLA_FLAGS"], batch=args.batch, seq=args.seq, reps=args.reps,
      remat=args.remat, scan_layers=not args.unroll, devices=str(jax.devices()), dtype=args.dtype,
      host=host_record(), shapes={},
  )
  peak, peak_cpu = matmul_peak_jax(args.matmul_size, args.reps)
  results.update(matmul_peak_gflops_jax=peak, matmul_peak_gflops_per_cpu_s_jax=peak_cpu)
  if not args.no_torch:
    import torch

    torch.set_num_threads(os.cpu_count())
    t_peak, t_peak_cpu = matmul_peak_torch(args.matmul_size, args.reps)
    results.update(matmul_peak_gflops_torch=t_peak, matmul_peak_gflops_per_cpu_s_torch=t_peak_cpu)
  for shape in args.shape:
    hf_cfg = hf_config(shape)
    config = config_from_hf(hf_cfg)
    n = matmul_params(config)
    entry = dict(matmul_params=n, tokens=tokens)
    entry["jax"] = bench_jax(config, args)
    if not args.no_torch:
      entry["torch"] = bench_torch(hf_cfg, args)
    for impl in ("jax", "torch"):
      if impl in entry:
        e = entry[impl]
        for kind, mult in (("forward", 2), ("train", 6)):
          e[kind + "_gflops"] = mult * n * tokens / e[kind + "_s"] / 1e9
          e[kind + "_frac_peak"] = e[kind + "_gflops"] / peak
          e[kind + "_gflops_per_cpu_s"] = mult * n * tokens / e[kind + "_cpu_s"] / 1e9
          e[kind + "_frac_peak_cpu"] = e[kind + "_gflops_per_cpu_s"] / peak_cpu
    kind = jax.devices()[0].device_kind  # MFU against the card's datasheet peak (accelerators)
    for pass_name, mult in (("forward", 2), ("train", 6)):
      entry["jax"][pass_name + "_accelerator"] = device_peaks.utilisation(
          kind, dtype=args.dtype, flops_per_s=mult * n * tokens / entry["jax"][pass_name + "_s"])
    results["shapes"][shape] = entry
    print(f"done {shape}", file=sys.stderr, flush=True)

  print(f"\nfp32 matmul peak ({args.matmul_size}^2, jnp.dot): {peak:.1f} GFLOP/s wall, "
        f"{peak_cpu:.1f} GFLOP per CPU-second"
        + (f"; torch.mm {results['matmul_peak_gflops_torch']:.1f} wall" if not args.no_torch
           else ""))
  print(f"batch {args.batch} x seq {args.seq}, remat={args.remat}, scan={not args.unroll}, "
        f"XLA_FLAGS='{results['xla_flags']}'")
  print(f"{'shape':<11} {'pass':<8} {'impl':<6} {'wall s':>7} {'GFLOP/s':>8} {'of peak':>8} "
        f"{'cpu s':>7} {'GF/cpu-s':>8} {'of peak':>8} {'jax speedup (wall, cpu)':>24}")
  for shape, entry in results["shapes"].items():
    for kind in ("forward", "train"):
      for impl in ("jax", "torch"):
        if impl not in entry:
          continue
        e = entry[impl]
        speed = ""
        if impl == "jax" and "torch" in entry:
          t = entry["torch"]
          speed = (f"{t[kind + '_s'] / e[kind + '_s']:.2f}x, "
                   f"{t[kind + '_cpu_s'] / e[kind + '_cpu_s']:.2f}x")
        print(f"{shape:<11} {kind:<8} {impl:<6} {e[kind + '_s']:>7.3f} "
              f"{e[kind + '_gflops']:>8.1f} {e[kind + '_frac_peak']:>8.0%} "
              f"{e[kind + '_cpu_s']:>7.3f} {e[kind + '_gflops_per_cpu_s']:>8.1f} "
              f"{e[kind + '_frac_peak_cpu']:>8.0%} {speed:>24}")
  results["peak_rss_mib"] = peak_rss_mib()
  print(f"peak RSS of this process (jax and torch): {results['peak_rss_mib'] / 1024:.2f} GiB")
  print(host_line(results["host"]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
