"""PPO update benchmark on the TRL reference workload, side by side with TRL when available.

Workload (the TRL CPU reference of the published comparison): a random GPT-2 policy with 4
layers, width 256, 4 heads, 256 positions and vocab 2048; random reward and value models of the
same shape (`GPT2ForSequenceClassification`, one label); batch 8; prompts of 28-32 tokens; 48
response tokens with no early EOS; 4 PPO epochs; 1 minibatch; fp32; fixed KL coefficient.
`--shape base` uses the 12-layer, width-768 body.

Both the training forward/backward and the sampler run their layers with `lax.scan`, the
library's default (`--train-layers` / `--rollout-layers`, the `PPOConfig` fields
`train_scan_layers` and `rollout_scan_layers`). Unrolled training layers were about 5% faster
at tiny (4 layers) and slower at base (12): there XLA:CPU fused the residual stream's gradient
sums into every weight-gradient transpose, recomputing them layer after layer (the update's op
time fell from 36 to 23 thread-seconds with the scan, in one profile on a shared host).

jax_ppo runs `--warmup` updates (compilation) and then `--updates` timed ones through
`PPOTrainer.step`, whose metrics split each update into rollout (sampling), scoring (reward
model) and update (reference log-probs, GAE, then 4 epochs of fwd+bwd and AdamW; with one
minibatch the first epoch's forward pass also gives the old log-probs and values).

Compile time: the run uses JAX's persistent compilation cache (`jax_ppo.compile_cache`) in a
fresh temporary folder (`--compile-cache`), so the first update of this process compiles cold;
then a second invocation (a new process on the same cache folder) times its first update, which
loads the programs instead. Both are reported against a steady update. Peak RSS is the
process's high-water mark (`rss.peak_rss_mib`); the second invocation's (which compiles
nothing) and TRL's are their own processes.

Memory: the random HF models are built with torch in a subprocess (`--model-python`, default
the TRL python), so this process holds no torch unless transformers imports it: it does, with
its configuration classes, whenever torch is installed in the environment (about +0.3 GiB). To
measure jax_ppo alone, run this script from an environment without torch (`pip install -e .`)
with `--trl-python`. The policy and value model use the library's default per-layer remat
(`--remat`, `jax_ppo.models.DEFAULT_REMAT`, "dots").

TRL side: with `--trl-python PATH` (a Python with this repository's `bench` extra:
`pip install -e ".[bench]"`, i.e. trl==1.12.0 and torch 2.13.0) the same run then starts
`trl_ppo_step.py` (the same models, prompts and settings through TRL's `PPOTrainer`) in a
subprocess and prints both side by side with the time ratio.

    python experiments/benchmarks/ppo_step.py [--shape tiny|base] [--json PATH]
        [--trl-python /tmp/trl-venv/bin/python] [--compile-cache fresh|DIR|off]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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
    "base": dict(n_layer=12, n_head=12, n_embd=768, n_positions=256, vocab_size=2048),
    # Qwen3-0.6B: 28 layers, width 1024, 16 query / 8 KV heads of 128, MLP 3072, tied embedding
    # of 151,936 tokens (the reward and value models are Qwen3ForSequenceClassification).
    "qwen3-0.6b": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True),
    # The same family at a smoke-test size.
    "qwen3-tiny": dict(model_type="qwen3", num_hidden_layers=2, hidden_size=128,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=2048, max_position_embeddings=512,
                       tie_word_embeddings=True),
}
"""Model shapes: keyword arguments of the family's Hugging Face config (`model_type`, default
"gpt2", picks the family)."""
LAYER_LOOPS = {"scan": True, "unroll": False}
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRL_BENCH = os.path.join(HERE, "trl_ppo_step.py")


def make_prompts(vocab_size: int, n: int = 256, seed: int = 1) -> list[list[int]]:
  """`n` random token-id prompts of 28-32 tokens (no pad or EOS id): the prompts of both sides."""
  import numpy as np

  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab_size - 2, size=int(rng.integers(28, 33))).tolist()
          for _ in range(n)]


def hf_configs(shape: dict) -> dict:
  """The Hugging Face configs of the random policy ("policy", a causal LM) and of the reward and
  value models ("reward", "value": one-label sequence classifiers) of `shape`."""
  import transformers

  shape = dict(shape)
  family = shape.pop("model_type", "gpt2")
  config_cls = {"gpt2": transformers.GPT2Config, "qwen3": transformers.Qwen3Config}[family]
  pad = shape["vocab_size"] - 1
  eos = shape["vocab_size"] - 2
  ids = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
  return {"policy": config_cls(**shape, **ids),
          **{name: config_cls(**shape, num_labels=1, **ids) for name in ("reward", "value")}}


def build_models(shape: dict, folder: str) -> dict[str, str]:
  """Random HF policy, reward and value models written to `folder`; returns their paths."""
  import torch
  import transformers

  torch.manual_seed(0)
  lm_cls, seq_cls = {
      "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2ForSequenceClassification),
      "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3ForSequenceClassification),
  }[shape.get("model_type", "gpt2")]
  paths = {}
  for name, cfg in hf_configs(shape).items():
    paths[name] = os.path.join(folder, name)
    (lm_cls if name == "policy" else seq_cls)(cfg).save_pretrained(paths[name])
  return paths


def build_models_elsewhere(shape_name: str, folder: str, python: str) -> dict[str, str]:
  """`build_models` in a subprocess of `python` (one with torch and transformers), so that this
  process never imports torch and its peak RSS is jax_ppo's own."""
  code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import ppo_step; "
          "print(json.dumps(ppo_step.build_models(ppo_step.SHAPES[sys.argv[2]], sys.argv[3])))")
  out = subprocess.run([python, "-c", code, HERE, shape_name, folder], capture_output=True,
                       text=True)
  if out.returncode != 0:
    raise SystemExit(
        f"Building the random HF models with {python} failed (it needs torch and transformers): "
        f"pass --model-python (or --trl-python) a python that has them.\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def ppo_config(args, vocab_size: int):
  """The run's `PPOConfig` (`args`: `batch`, `response_length`, `warmup`, `updates`,
  `train_layers`, `rollout_layers`; the same fields of a result's "config" record)."""
  from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling

  return PPOConfig(
      batch_size=args.batch, num_minibatches=1, ppo_epochs=4,
      sampling=PPOSampling(max_new_tokens=args.response_length, temperature=0.7,
                           stop_token_ids=(), pad_token_id=vocab_size - 1),
      kl_coef=0.05,
      kl_controller="fixed", optimizer=PPOOptimizer(learning_rate=3e-6),
      total_updates=args.warmup + args.updates,
      vf_coef=0.1,
      train_scan_layers=LAYER_LOOPS[args.train_layers],
      rollout_scan_layers=LAYER_LOOPS[args.rollout_layers],
  )


def run_jax(args, shape: dict) -> dict:
  import jax.numpy as jnp

  import jax_ppo.models as models
  from jax_ppo.data import PromptDataset
  from jax_ppo.ppo import PPOTrainer
  from jax_ppo.ppo.perf import measure_matmul_peak

  with tempfile.TemporaryDirectory() as tmp:
    paths = build_models_elsewhere(args.shape, tmp, args.model_python or sys.executable)
    # Compute in `--dtype`; weights, gradients and optimizer state stay float32 (master
    # weights), as `RunConfig.dtype` loads them.
    dtype = jnp.dtype(args.dtype)
    policy = models.from_pretrained(paths["policy"], remat=args.remat, dtype=dtype,
                                    param_dtype=jnp.float32)
    reward = models.load_scalar_model(paths["reward"], dtype=dtype, param_dtype=jnp.float32)
    value = models.load_scalar_model(paths["value"], remat=args.remat, dtype=dtype,
                                     param_dtype=jnp.float32)
  vocab = shape["vocab_size"]
  prompts = make_prompts(vocab)
  total = args.warmup + args.updates
  config = ppo_config(args, vocab)
  peak = measure_matmul_peak(2048)
  t0 = time.perf_counter()
  trainer = PPOTrainer(
      config, policy, reward=reward, value_model=value, prompts=PromptDataset(prompts, seed=0),
      peak_flops=peak,
  )
  init_s = time.perf_counter() - t0
  if args.first_update_only:  # the second invocation: one update on a warm compilation cache
    m = trainer.step()
    print(f"second invocation: trainer built in {init_s:.3f}s, first update "
          f"{m['time/total_s']:.3f}s", flush=True)
    return {"first_update_s": m["time/total_s"], "trainer_init_s": init_s,
            "peak_rss_mib": peak_rss_mib(), "torch_imported": "torch" in sys.modules}
  history = []
  t0 = time.perf_counter()
  for i in range(total):
    m = trainer.step()
    history.append(m)
    tag = "warm-up" if i < args.warmup else "timed"
    print(f"update {i + 1} ({tag}): {m['time/total_s']:.3f}s | rollout {m['time/rollout_s']:.3f}s"
          f" | score {m['time/score_s']:.3f}s | update {m['time/update_s']:.3f}s", flush=True)
  wall = time.perf_counter() - t0
  timed = history[args.warmup:]
  med = lambda k: statistics.median(m[k] for m in timed)  # noqa: E731
  return {
      "s_per_update": med("time/total_s"),
      "rollout_s": med("time/rollout_s"),
      "score_s": med("time/score_s"),
      "update_s": med("time/update_s"),
      "first_update_s": history[0]["time/total_s"],
      "trainer_init_s": init_s,
      "peak_rss_mib": peak_rss_mib(),
      # transformers imports torch with its configs whenever torch is installed (+0.3 GiB)
      "torch_imported": "torch" in sys.modules,
      "mfu": med("mfu"),
      "matmul_peak_gflops": peak / 1e9,
      "tokens_per_s": med("tokens_per_s"),
      "wall_s_all_updates": wall,
  }


def run_trl(args) -> dict | None:
  if not args.trl_python:
    return None
  if not os.path.exists(args.trl_bench):
    print(f"TRL benchmark script not found at {args.trl_bench}; skipping TRL.")
    return None
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "trl.json")
    cmd = [args.trl_python, args.trl_bench, "--shape", args.shape, "--updates",
           str(args.warmup + args.updates), "--threads", str(args.trl_threads), "--json", out]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr)
    with open(out) as f:
      trl = json.load(f)
  return {
      **{k: trl[k] for k in ("s_per_update", "rollout_s", "score_s", "update_s",
                             "first_update_s", "peak_rss_mib", "versions", "torch_threads")},
      "note": "TRL's score_s covers the ref, value and reward forwards; jax_ppo's update_s "
              "includes its ref forward (its old log-probs and values come from the first "
              "epoch's forward pass).",
  }


def run_second_invocation(args, cache_dir: str) -> dict:
  """The first update of a new process on the compilation cache this one filled."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "second.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--batch",
           str(args.batch), "--response-length", str(args.response_length), "--train-layers",
           args.train_layers, "--rollout-layers", args.rollout_layers, "--remat", args.remat,
           "--dtype", args.dtype, "--compile-cache", cache_dir, "--first-update-only",
           "--json", out]
    if args.model_python:
      cmd += ["--model-python", args.model_python]
    print("second invocation:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr)
    with open(out) as f:
      return json.load(f)["jax_ppo"]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--response-length", type=int, default=48)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--updates", type=int, default=6)
  ap.add_argument("--train-layers", choices=sorted(LAYER_LOOPS), default="scan",
                  help="layer loop of the training forward/backward (PPOConfig.train_scan_layers)")
  ap.add_argument("--rollout-layers", choices=sorted(LAYER_LOOPS), default="scan",
                  help="layer loop of the sampler (PPOConfig.rollout_scan_layers)")
  ap.add_argument("--remat", default=None,
                  help="per-layer remat of the policy and value model (default: the library's, "
                       "jax_ppo.models.DEFAULT_REMAT)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                  help="compute dtype of every model (RunConfig.dtype); weights, gradients and "
                       "optimizer state stay float32. MFU is taken against the datasheet peak "
                       "of this dtype on an accelerator")
  ap.add_argument("--model-python", default=None,
                  help="python that builds the random HF models (needs torch + transformers); "
                       "default: --trl-python, else this python. A subprocess either way, so "
                       "this process imports torch only if transformers does (torch installed)")
  ap.add_argument("--compile-cache", default="fresh",
                  help="persistent compilation cache: 'fresh' (default: a new temporary folder, "
                       "so this run compiles cold and the second invocation loads from it), a "
                       "folder, or 'off'")
  ap.add_argument("--second-invocation", action=argparse.BooleanOptionalAction, default=True,
                  help="after the timed updates, time the first update of a new process on the "
                       "same compilation cache (needs the cache)")
  ap.add_argument("--first-update-only", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--trl-python", default=None,
                  help="python of a venv with the `bench` extra (trl==1.12.0), e.g. "
                       "/tmp/trl-venv/bin/python")
  ap.add_argument("--trl-bench", default=DEFAULT_TRL_BENCH)
  ap.add_argument("--trl-threads", type=int, default=0,
                  help="torch threads of the TRL side (0: torch's default, one per core). On a "
                       "host shared with other busy processes torch's OpenMP threads can slow "
                       "down many times over (measured: 2 threads 15-22 s/update, 1 thread "
                       "3.9 s, at tiny, on 2 cores with another process using one); compare "
                       "on a quiet host, or also run with --trl-threads 1")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  shape = SHAPES[args.shape]
  args.model_python = args.model_python or args.trl_python
  if args.remat is None:
    from jax_ppo.models import DEFAULT_REMAT

    args.remat = DEFAULT_REMAT

  import jax

  from jax_ppo.compile_cache import enable_compilation_cache

  fresh_cache = args.compile_cache == "fresh"
  cache_dir = None
  if fresh_cache:
    cache_dir = tempfile.mkdtemp(prefix="jax_ppo_bench_cache_")
  elif args.compile_cache != "off":
    cache_dir = args.compile_cache
  if cache_dir is not None:
    enable_compilation_cache(cache_dir)
  results = {"jax_ppo": run_jax(args, shape)}
  if args.first_update_only:
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f)
    return results
  if args.second_invocation and cache_dir is not None:
    second = run_second_invocation(args, cache_dir)
    results["jax_ppo"]["second_invocation_first_update_s"] = second["first_update_s"]
    results["jax_ppo"]["second_invocation_trainer_init_s"] = second["trainer_init_s"]
    results["jax_ppo"]["second_invocation_peak_rss_mib"] = second["peak_rss_mib"]
    results["jax_ppo"]["cache_entries"] = len(os.listdir(cache_dir))
  if fresh_cache:
    shutil.rmtree(cache_dir, ignore_errors=True)
  import device_peaks  # MFU against the card's datasheet peak (None on a CPU)

  r = results["jax_ppo"]
  r["accelerator"] = device_peaks.utilisation(
      jax.devices()[0].device_kind, dtype=args.dtype,
      flops_per_s=r["mfu"] * r["matmul_peak_gflops"] * 1e9)
  trl = run_trl(args)
  if trl is not None:
    results["trl"] = trl
    results["jax_ppo_over_trl_time"] = results["jax_ppo"]["s_per_update"] / trl["s_per_update"]
  results["config"] = dict(
      shape=args.shape, **shape, batch=args.batch, prompt_len="28-32",
      response_length=args.response_length, ppo_epochs=4, num_minibatches=1, dtype=args.dtype,
      warmup=args.warmup, updates=args.updates, train_layers=args.train_layers,
      rollout_layers=args.rollout_layers, remat=args.remat, compile_cache=args.compile_cache,
      backend=jax.default_backend(), jax=jax.__version__,
  )
  results["host"] = host_record()
  print(f"\nPPO update benchmark ({args.shape}, batch {args.batch}, {args.response_length} "
        f"response tokens, 4 epochs, {args.dtype}, {jax.default_backend()})")
  print(f"{'impl':<8} {'s/update':>9} {'rollout':>9} {'score':>9} {'update':>9} "
        f"{'1st upd':>9} {'1st (2nd run)':>14} {'peak RSS':>10} {'(2nd run)':>10}")
  for name in ("jax_ppo", "trl"):
    if name in results:
      r = results[name]
      second = r.get("second_invocation_first_update_s")
      second = "-" if second is None else f"{second:.3f}"
      rss2 = r.get("second_invocation_peak_rss_mib")
      rss2 = "-" if rss2 is None else f"{rss2 / 1024:.2f} GiB"
      print(f"{name:<8} {r['s_per_update']:>9.3f} {r['rollout_s']:>9.3f} {r['score_s']:>9.3f} "
            f"{r['update_s']:>9.3f} {r['first_update_s']:>9.3f} {second:>14} "
            f"{r['peak_rss_mib'] / 1024:>6.2f} GiB {rss2:>10}")
  print(f"jax_ppo: remat {args.remat}; torch imported in its process: "
        f"{results['jax_ppo']['torch_imported']} (transformers imports it with its configs "
        f"when installed; run this script from an environment without torch and pass "
        f"--trl-python / --model-python to measure jax_ppo alone)")
  if "jax_ppo_over_trl_time" in results:
    print(f"jax_ppo time / TRL time: {results['jax_ppo_over_trl_time']:.2f}")
  print(f"jax_ppo MFU: {results['jax_ppo']['mfu']:.3f} of a "
        f"{results['jax_ppo']['matmul_peak_gflops']:.0f} GFLOP/s matmul peak")
  print(host_line(results["host"]))
  acc = results["jax_ppo"]["accelerator"]
  if acc["mfu"] is not None:
    print(f"jax_ppo MFU: {acc['mfu']:.4f} of the {acc['peak_table_key']} datasheet {args.dtype} "
          f"peak ({acc['peak_flops'] / 1e12:.0f} TFLOP/s)")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
