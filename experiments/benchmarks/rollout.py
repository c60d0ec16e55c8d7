"""Rollout benchmark: jax_ppo's compiled sampler against Hugging Face `generate`, side by side.

Both run the same random GPT-2 weights (built with transformers, handed to jax_ppo through
`save_pretrained` / `from_pretrained`) in one process, on the same prompts, with the sampling
settings of TRL's PPO rollout (temperature 0.7, top_k 0, top_p 1.0) and no stop token, so every
call produces exactly `--new-tokens` tokens per row. The default shape is the TRL reference
workload of `shared/peers/trl_cpu` (4 layers, 4 heads, width 256, 256 positions, vocab 2048;
batch 8; 32-token prompts; 48 new tokens). `--shape base` is the 86M body of `ppo_step.py --shape
base` (12 layers, width 768, vocab 2048); `--shape gpt2-small --batch 64` is the larger one.
The JSON and the table also give the process's peak RSS (both implementations run in it).

Reports, per implementation, the median wall time of one generate call after warm-up, the
milliseconds per decode step (time / new tokens) and generated tokens per second, and the ratio.
It also reports the memory floor: a decode step at small batch reads every weight and the KV
cache once for a few flops per byte, so the time to read that many bytes (measured: a jitted sum
over an array of the same size, read repeatedly, so caches help it as much as they can help a
decode step) bounds the step time from below, and `hf ms/step / floor` bounds the speedup any
implementation can reach over HF on this machine.

    python experiments/benchmarks/rollout.py [--shape tiny|base|gpt2-small] [--batch 8]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402
from rss import peak_rss_mib  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHAPES = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=256, n_positions=256, vocab_size=2048),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257),
    # The 86M "base" shape of ppo_step.py (GPT-2 small body, vocab 2048).
    "base": dict(n_layer=12, n_head=12, n_embd=768, n_positions=256, vocab_size=2048),
}


def _time(fn, warmup: int, reps: int) -> list[float]:
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def _summary(times: list[float], batch: int, new_tokens: int) -> dict:
  med = statistics.median(times)
  return {
      "median_s_per_generate": med,
      "min_s_per_generate": min(times),
      "ms_per_step": 1000 * med / new_tokens,
      "tokens_per_s": batch * new_tokens / med,
      "reps": len(times),
  }


def _read_bandwidth(nbytes: int, reps: int = 20) -> float:
  """Bytes/s of a jitted sum over a `nbytes` float32 array read again and again (so a working
  set that fits a cache level is read at that level's speed), best of `reps`."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((nbytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = min(_time(lambda: total(x).block_until_ready(), 0, reps))
  return nbytes / best


def _decode_bytes_per_step(model_config, *, params_bytes: int, batch: int, cache_len: int,
                           cache_itemsize: int = 4) -> int:
  """Bytes one decode step must read at least: every weight once plus the whole KV cache.

  At batch 8 a decode step does 16 flops per 4-byte fp32 weight, so on a CPU it is bound by
  memory bandwidth, not by the matmul peak; this is the floor that bounds any implementation.
  """
  from jax_ppo.rollout.sampler import kv_cache_bytes

  return params_bytes + kv_cache_bytes(model_config, batch_size=batch, max_length=cache_len,
                                       itemsize=cache_itemsize)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=48)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                  help="compute dtype of the sampler (and of its KV cache)")
  ap.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                  help="dtype the weights are stored in: float32 is what a PPO run samples "
                       "from (its master weights); bfloat16 halves the weight bytes each decode "
                       "step reads")
  ap.add_argument("--decode-segments", type=int, default=None,
                  help="the sampler's length-bucketed decode loops K (default: SamplingConfig's; "
                       "1: one loop reading the whole cache at every step)")
  ap.add_argument("--json", default=None, help="write the results here")
  ap.add_argument("--no-hf", action="store_true",
                  help="skip the Hugging Face generate reference (e.g. on an accelerator)")
  args = ap.parse_args(argv)

  import device_peaks
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  import jax_ppo.models as models
  from jax_ppo.ppo.perf import count_params
  from jax_ppo.rollout.config import SamplingConfig
  from jax_ppo.rollout.sampler import Sampler, param_bytes

  shape = SHAPES[args.shape]
  rng = np.random.default_rng(1)
  prompts = rng.integers(0, shape["vocab_size"], size=(args.batch, args.prompt_len))

  with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(**shape, pad_token_id=shape["vocab_size"] - 1)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.save_pretrained(tmp)
    model = models.from_pretrained(tmp, dtype=jnp.dtype(args.dtype),
                                   param_dtype=jnp.dtype(args.param_dtype))

    sampling = SamplingConfig(
        max_new_tokens=args.new_tokens, temperature=0.7, top_k=0, top_p=1.0,
        stop_token_ids=(), pad_token_id=shape["vocab_size"] - 1,
        prompt_buckets=(args.prompt_len,), batch_buckets=(args.batch,),
        **({} if args.decode_segments is None else {"decode_segments": args.decode_segments}),
    )
    sampler = Sampler(model, sampling)
    key = jax.random.PRNGKey(0)
    prompt_list = prompts.tolist()

    def run_jax():
      out = sampler(prompt_list, key)
      jax.block_until_ready(out)
      assert out.response_ids.shape == (args.batch, args.new_tokens)

    t0 = time.perf_counter()
    run_jax()
    compile_s = time.perf_counter() - t0
    results = {"jax_ppo": _summary(_time(run_jax, args.warmup, args.reps), args.batch,
                                   args.new_tokens)}
    results["jax_ppo"]["first_call_s"] = compile_s

    if not args.no_hf:  # --no-hf: jax_ppo only
      input_ids = torch.tensor(prompts, dtype=torch.long)
      mask = torch.ones_like(input_ids)
      gen = transformers.GenerationConfig(
          max_new_tokens=args.new_tokens, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
          pad_token_id=hf_config.pad_token_id, eos_token_id=None,
      )

      def run_hf():
        with torch.no_grad():
          out = hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
        assert out.shape[1] - args.prompt_len == args.new_tokens

      results["hf"] = _summary(_time(run_hf, args.warmup, args.reps), args.batch, args.new_tokens)
      results["speedup_tokens_per_s"] = (
          results["jax_ppo"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
      )

  step_bytes = _decode_bytes_per_step(
      model.config, params_bytes=param_bytes(sampler.state), batch=args.batch,
      cache_len=args.prompt_len + args.new_tokens - 1,
      cache_itemsize=jnp.dtype(args.dtype).itemsize,
  )
  bandwidth = _read_bandwidth(step_bytes)
  floor_ms = 1000 * step_bytes / bandwidth
  results["memory_floor"] = {
      "read_gb_per_s": bandwidth / 1e9,
      "bytes_per_decode_step": step_bytes,
      "floor_ms_per_step": floor_ms,
      "jax_ppo_over_floor": results["jax_ppo"]["ms_per_step"] / floor_ms,
  }
  if "hf" in results:
    results["memory_floor"]["max_speedup_over_hf"] = results["hf"]["ms_per_step"] / floor_ms
  # MFU and HBM use against the card's datasheet peaks (None on a CPU): model FLOPs 2N per
  # token over prompt and response, and the weights + KV cache read once per decode step.
  gen_s = results["jax_ppo"]["median_s_per_generate"]
  results["jax_ppo"]["accelerator"] = device_peaks.utilisation(
      jax.devices()[0].device_kind, dtype=args.dtype,
      flops_per_s=2 * count_params(sampler.state) * args.batch
      * (args.prompt_len + args.new_tokens) / gen_s,
      bytes_per_s=step_bytes * args.new_tokens / gen_s,
  )
  results["peak_rss_mib"] = peak_rss_mib()
  results["host"] = host_record()
  summary = {
      **results,
      "config": dict(
          shape=args.shape, **shape, batch=args.batch, prompt_len=args.prompt_len,
          new_tokens=args.new_tokens, warmup=args.warmup, reps=args.reps, dtype=args.dtype,
          param_dtype=args.param_dtype, decode_segments=sampling.decode_segments,
          sampling="temperature=0.7, top_k=0, top_p=1.0, no stop token",
          backend=jax.default_backend(), jax=jax.__version__,
      ),
  }
  print(f"\nRollout benchmark ({args.shape}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {args.dtype} compute, {args.param_dtype} weights, "
        f"{jax.default_backend()})")
  print(f"{'impl':<10} {'ms/step':>10} {'tokens/s':>12} {'s/generate':>12}")
  for name in ("jax_ppo", "hf"):
    if name in results:
      r = results[name]
      print(f"{name:<10} {r['ms_per_step']:>10.3f} {r['tokens_per_s']:>12.1f} "
            f"{r['median_s_per_generate']:>12.4f}")
  if "speedup_tokens_per_s" in results:
    print(f"jax_ppo / hf tokens/s: {results['speedup_tokens_per_s']:.2f}x")
  mf = results["memory_floor"]
  print(f"memory floor: {mf['bytes_per_decode_step'] / 2**20:.1f} MiB read per decode step "
        f"(weights + KV cache) at {mf['read_gb_per_s']:.1f} GB/s = {mf['floor_ms_per_step']:.2f} "
        f"ms/step; jax_ppo is at {mf['jax_ppo_over_floor']:.2f}x the floor"
        + (f"; the most any implementation can gain over hf here is "
           f"{mf['max_speedup_over_hf']:.1f}x" if "max_speedup_over_hf" in mf else ""))
  acc = results["jax_ppo"]["accelerator"]
  if acc["mfu"] is not None:
    print(f"jax_ppo on {acc['peak_table_key']}: {acc['hbm_bandwidth_use']:.3f} of the datasheet "
          f"HBM bandwidth ({acc['peak_hbm_bytes_s'] / 1e12:.2f} TB/s), MFU {acc['mfu']:.4f}")
  print(f"peak RSS of this process (both implementations): "
        f"{results['peak_rss_mib'] / 1024:.2f} GiB")
  print(host_line(results["host"]))
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=2)
  return summary


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
