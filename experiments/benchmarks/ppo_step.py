"""PPO update benchmark on the TRL reference workload, side by side with TRL when available.

Workload (shared/peers/trl_cpu): a random GPT-2 policy with 4 layers, width 256, 4 heads, 256
positions and vocab 2048; random reward and value models of the same shape
(`GPT2ForSequenceClassification`, one label); batch 8; prompts of 28-32 tokens; 48 response tokens
with no early EOS; 4 PPO epochs; 1 minibatch; fp32; fixed KL coefficient. `--shape base` uses the
12-layer, width-768 body.

The training forward/backward runs its layers unrolled and the sampler scans them
(`--train-layers` / `--rollout-layers`, the `PPOConfig` fields `train_scan_layers` and
`rollout_scan_layers`), the fastest pair on CPU at this shape.

jax_ppo runs `--warmup` updates (compilation) and then `--updates` timed ones through
`PPOTrainer.step`, whose metrics split each update into rollout (sampling), scoring (reward
model) and update (reference log-probs, GAE, then 4 epochs of fwd+bwd and AdamW; with one
minibatch the first epoch's forward pass also gives the old log-probs and values).
With `--trl-python PATH` (a Python with trl==1.12.0, see shared/peers/trl_cpu/README.md) the
same run then starts TRL's benchmark script in a subprocess and reports the ratio.

    python experiments/benchmarks/ppo_step.py [--shape tiny|base] [--json PATH]
        [--trl-python /tmp/trl-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHAPES = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=256, n_positions=256, vocab_size=2048),
    "base": dict(n_layer=12, n_head=12, n_embd=768, n_positions=256, vocab_size=2048),
}
LAYER_LOOPS = {"scan": True, "unroll": False}
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRL_BENCH = os.path.normpath(
    os.path.join(HERE, "..", "..", "..", "shared", "peers", "trl_cpu", "trl_ppo_bench.py")
)


def _build_models(shape: dict, folder: str) -> dict[str, str]:
  """Random HF policy, reward and value models written to `folder`; returns their paths."""
  import torch
  import transformers

  torch.manual_seed(0)
  pad = shape["vocab_size"] - 1
  eos = shape["vocab_size"] - 2
  cfg = transformers.GPT2Config(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
  paths = {}
  paths["policy"] = os.path.join(folder, "policy")
  transformers.GPT2LMHeadModel(cfg).save_pretrained(paths["policy"])
  for name in ("reward", "value"):
    paths[name] = os.path.join(folder, name)
    seq_cfg = transformers.GPT2Config(**shape, num_labels=1, bos_token_id=eos, eos_token_id=eos,
                                      pad_token_id=pad)
    transformers.GPT2ForSequenceClassification(seq_cfg).save_pretrained(paths[name])
  return paths


def run_jax(args, shape: dict) -> dict:
  import numpy as np

  import jax_ppo.models as models
  from jax_ppo.data import PromptDataset
  from jax_ppo.trainer import PPOConfig, PPOTrainer
  from jax_ppo.trainer.perf import measure_matmul_peak

  with tempfile.TemporaryDirectory() as tmp:
    paths = _build_models(shape, tmp)
    policy = models.from_pretrained(paths["policy"])
    reward = models.load_scalar_model(paths["reward"])
    value = models.load_scalar_model(paths["value"])
  vocab = shape["vocab_size"]
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(0, vocab - 2, size=int(rng.integers(28, 33)))) for _ in range(256)]
  total = args.warmup + args.updates
  config = PPOConfig(
      batch_size=args.batch, num_minibatches=1, ppo_epochs=4, max_new_tokens=args.response_length,
      temperature=0.7, stop_token_ids=(), pad_token_id=vocab - 1, kl_coef=0.05,
      kl_controller="fixed", learning_rate=3e-6, total_updates=total, vf_coef=0.1,
      train_scan_layers=LAYER_LOOPS[args.train_layers],
      rollout_scan_layers=LAYER_LOOPS[args.rollout_layers],
  )
  peak = measure_matmul_peak(2048)
  trainer = PPOTrainer(
      config, policy, reward=reward, value_model=value, prompts=PromptDataset(prompts, seed=0),
      peak_flops=peak,
  )
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
           str(args.warmup + args.updates), "--json", out]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr)
    with open(out) as f:
      trl = json.load(f)
  return {
      "s_per_update": trl["median_update_s_after_first"],
      "rollout_s": trl["median_gen_s_after_first"],
      "score_s": trl["median_rollout_score_s_after_first"],
      "update_s": trl["median_ppo_opt_s_after_first"],
      "note": "TRL's score_s covers the ref, value and reward forwards; jax_ppo's update_s "
              "includes its ref forward (its old log-probs and values come from the first "
              "epoch's forward pass).",
  }


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--response-length", type=int, default=48)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--updates", type=int, default=6)
  ap.add_argument("--train-layers", choices=sorted(LAYER_LOOPS), default="unroll",
                  help="layer loop of the training forward/backward (PPOConfig.train_scan_layers)")
  ap.add_argument("--rollout-layers", choices=sorted(LAYER_LOOPS), default="scan",
                  help="layer loop of the sampler (PPOConfig.rollout_scan_layers)")
  ap.add_argument("--trl-python", default=None, help="python of a venv with trl==1.12.0")
  ap.add_argument("--trl-bench", default=DEFAULT_TRL_BENCH)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  shape = SHAPES[args.shape]

  import jax

  results = {"jax_ppo": run_jax(args, shape)}
  import device_peaks  # MFU against the card's datasheet peak (None on a CPU)

  r = results["jax_ppo"]
  r["accelerator"] = device_peaks.utilisation(
      jax.devices()[0].device_kind, dtype="float32",
      flops_per_s=r["mfu"] * r["matmul_peak_gflops"] * 1e9)
  trl = run_trl(args)
  if trl is not None:
    results["trl"] = trl
    results["jax_ppo_over_trl_time"] = results["jax_ppo"]["s_per_update"] / trl["s_per_update"]
  results["config"] = dict(
      shape=args.shape, **shape, batch=args.batch, prompt_len="28-32",
      response_length=args.response_length, ppo_epochs=4, num_minibatches=1, dtype="float32",
      warmup=args.warmup, updates=args.updates, train_layers=args.train_layers,
      rollout_layers=args.rollout_layers, backend=jax.default_backend(),
      jax=jax.__version__,
  )
  print(f"\nPPO update benchmark ({args.shape}, batch {args.batch}, {args.response_length} "
        f"response tokens, 4 epochs, {jax.default_backend()})")
  print(f"{'impl':<8} {'s/update':>9} {'rollout':>9} {'score':>9} {'update':>9}")
  for name in ("jax_ppo", "trl"):
    if name in results:
      r = results[name]
      print(f"{name:<8} {r['s_per_update']:>9.3f} {r['rollout_s']:>9.3f} {r['score_s']:>9.3f} "
            f"{r['update_s']:>9.3f}")
  if "jax_ppo_over_trl_time" in results:
    print(f"jax_ppo time / TRL time: {results['jax_ppo_over_trl_time']:.2f} (target <= 0.5)")
  print(f"jax_ppo MFU: {results['jax_ppo']['mfu']:.3f} of a "
        f"{results['jax_ppo']['matmul_peak_gflops']:.0f} GFLOP/s matmul peak")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
