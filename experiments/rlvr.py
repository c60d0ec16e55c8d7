"""RL with a verifiable reward: GRPO, DAPO, GSPO, CISPO, Dr. GRPO, PPO and online DPO on arithmetic.

    python experiments/rlvr.py                        # every algorithm; see --help
    python experiments/rlvr.py --algorithms grpo,gspo --updates 40
    python experiments/rlvr.py --smoke                # CI sizes, ~5 minutes: docs/usage.md's table

Nothing is downloaded. The task is the package's seeded arithmetic problems
(`jax_ppo.data.arithmetic`: "Q: What is 37 + 48?\\nA:", train and held-out problems never meet)
scored by exact match (`reward_function=arithmetic_exact_match`, 1.0 when the response's final
answer is the result). A tiny decoder with a byte-level tokenizer that splits digits is trained
from random weights by SFT on worked answers (`out/sft/hf`), then each algorithm trains that
same SFT model on the RL prompts (`out/data/rl.jsonl`, the first `rl_problems` SFT problems)
through the run configs users write (`jax-ppo train`; `jax-ppo dpo` with `prompts_path` for
online DPO; `out/<algorithm>/`). The script measures, for the SFT model and each result, the
greedy exact match on the held-out problems and on the RL prompts, and the sampled exact match on
the RL prompts (`eval_samples` responses per prompt at the training temperature: the expected
reward that RL maximises). It also records the KL to the SFT model and the response length at
the last update, and the wall time of the RL stage. It writes
`out/summary.json` and prints the Markdown table of docs/usage.md ("The algorithms on a
verifiable task").

Running the same command again reuses the data, the SFT model and every finished algorithm (a
run whose exported model is in `out/<algorithm>/hf`).

The algorithms (`ALGORITHMS`), each the same batch geometry (prompts x `n_samples` responses,
`ppo_epochs` epochs of two minibatches) and learning rate, differing only in what each paper
changes:
* `grpo`: group-normalised advantages, PPO's clipped token ratio, a k3 KL loss to the reference;
* `dapo`: clip-higher (0.2 / 0.28), token-level loss, no KL, overlong reward shaping, dynamic
  sampling (groups whose responses all score the same are replaced by further prompts);
* `gspo`: the sequence-level, length-normalised ratio clipped per sequence (3e-4 / 4e-4), no KL;
* `cispo`: the clipped, stop-gradient importance weight (at most 1.28) times the log-prob, no KL;
* `dr_grpo`: advantages not divided by the group's std, the `token-sum-norm` reduction, no KL;
* `ppo`: a critic (a value head on the policy trunk), GAE, the KL penalty in the reward;
* `online_dpo`: `jax-ppo dpo` with `prompts_path`: two samples per prompt, the reward picks the
  chosen and rejected one, one DPO step (beta 0.1) against the SFT model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

ALGORITHMS: Mapping[str, Mapping[str, Any]] = {
    "grpo": {"ppo": {"advantage_mode": "grpo", "kl_in_reward": False, "kl_coef": 0.02,
                     "kl_loss_estimator": "k3"}},
    "dapo": {"ppo": {"advantage_mode": "grpo", "kl_coef": 0.0, "kl_in_reward": False,
                     "clip_eps": 0.2, "clip_eps_high": 0.28, "loss_reduction": "token-mean",
                     "overlong_cache_length": 4, "overlong_penalty": 1.0,
                     "dynamic_sampling": True}},
    "gspo": {"ppo": {"advantage_mode": "grpo", "kl_coef": 0.0, "kl_in_reward": False,
                     "policy_loss": "gspo", "clip_eps": 3e-4, "clip_eps_high": 4e-4,
                     "loss_reduction": "seq-mean-token-mean"}},
    "cispo": {"ppo": {"advantage_mode": "grpo", "kl_coef": 0.0, "kl_in_reward": False,
                      "policy_loss": "cispo", "clip_eps_high": 0.28}},
    "dr_grpo": {"ppo": {"advantage_mode": "grpo", "grpo_scale": "none", "kl_coef": 0.0,
                        "kl_in_reward": False, "loss_reduction": "token-sum-norm"}},
    "ppo": {"ppo": {"advantage_mode": "gae", "kl_coef": 0.02, "vf_coef": 0.5,
                    "whiten_advantages": True}},
}
"""Each algorithm's `RunConfig` fields over the shared ones (`rl_config`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLVRConfig:
  """The sizes of one experiment (`--smoke`: `smoke()`)."""

  seed: int = 0
  digits: int = 2
  """Operand digits of the problems (`ArithmeticConfig.digits`)."""
  operations: str = "+"
  """The operations drawn, e.g. "+-"."""
  train_problems: int = 4000
  rl_problems: int = 256
  """The RL prompts: the first this many training problems (`out/data/rl.jsonl`), each seen by
  SFT too; their exact match is measured beside the held-out one."""
  eval_problems: int = 200
  eval_samples: int = 32
  """Responses sampled per RL prompt at `temperature` for the sampled exact match."""
  vocab_size: int = 300
  hidden_size: int = 128
  num_layers: int = 3
  num_heads: int = 4
  sft_steps: int = 1000
  sft_batch_size: int = 32
  sft_learning_rate: float = 3e-3
  updates: int = 40
  """RL updates per algorithm."""
  prompts_per_update: int = 16
  n_samples: int = 8
  ppo_epochs: int = 2
  """Passes over each update's batch (two minibatches each)."""
  learning_rate: float = 1e-4
  temperature: float = 1.0
  max_new_tokens: int = 24
  """Response length limit (a worked answer of 2-digit operands is about 20 tokens)."""

  def __post_init__(self):
    # The run configs check the fields they receive; this one is the script's own.
    if isinstance(self.eval_samples, bool) or not isinstance(self.eval_samples, int) \
        or self.eval_samples < 1:
      raise ValueError(f"eval_samples={self.eval_samples!r}: give an int >= 1, the responses "
                       "sampled per RL prompt for the sampled exact match (e.g. 32).")


def smoke(**overrides) -> RLVRConfig:
  """CI sizes: one-digit sums and differences, a 2-layer width-64 decoder, a short SFT, RL on
  16 of its problems, every one of them in each of 48 updates. Responses may run to 20 tokens,
  past the worked answers' 14 to 15, so DAPO's 4-token overlong window penalises only responses
  that run on after an answer."""
  fields = dict(digits=1, operations="+-", train_problems=150, rl_problems=16, eval_problems=16,
                hidden_size=64, num_layers=2, sft_steps=300, updates=48, prompts_per_update=16,
                n_samples=4, max_new_tokens=20)
  return RLVRConfig(**{**fields, **overrides})


# -- data, tokenizer and SFT --------------------------------------------------------------------


def stage_data(cfg: RLVRConfig, out: pathlib.Path):
  """The task's files and the tokenizer (`out/data`), reused when there."""
  from transformers import AutoTokenizer

  from jax_ppo.data.arithmetic import ArithmeticConfig, write_task
  from jax_ppo.quickstart.tokenizer_training import train_bpe_tokenizer

  d = out / "data"
  tok_dir = d / "tokenizer"
  if not (tok_dir / "tokenizer.json").exists():
    paths = write_task(d, seed=cfg.seed, train=cfg.train_problems, eval=cfg.eval_problems,
                       config=ArithmeticConfig(digits=cfg.digits,
                                               operations=tuple(cfg.operations)))
    texts = [r["prompt"] + r["response"] for r in read_jsonl(paths["sft_train"])]
    tok = train_bpe_tokenizer(texts, vocab_size=cfg.vocab_size, split_digits=True)
    tok.save_pretrained(str(tok_dir))
    rl = read_jsonl(paths["train"])[:cfg.rl_problems]
    (d / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rl))
  return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def stage_sft(cfg: RLVRConfig, out: pathlib.Path, tokenizer, *, progress: bool) -> pathlib.Path:
  """Trains the random-init decoder on the worked answers; returns its HF folder."""
  from flax import nnx

  from jax_ppo.models import CausalLM, ModelConfig
  from jax_ppo.sft import SFTConfig, SFTOptimizer, SFTTrainer
  from jax_ppo.training.loop import RunOptions

  run_dir = out / "sft"
  hf = run_dir / "hf"
  if (hf / "config.json").exists():
    return hf
  config = ModelConfig(
      model_type="llama", vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
      intermediate_size=4 * cfg.hidden_size, num_layers=cfg.num_layers,
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
      head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=128,
      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
      eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
  sft = SFTConfig(
      max_length=48, batch_size=cfg.sft_batch_size, total_steps=cfg.sft_steps, seed=cfg.seed,
      optimizer=SFTOptimizer(learning_rate=cfg.sft_learning_rate, lr_schedule="cosine",
                             warmup_steps=max(1, cfg.sft_steps // 20), weight_decay=0.0))
  model = CausalLM(config, rngs=nnx.Rngs(cfg.seed))
  options = RunOptions(save_every=max(1, cfg.sft_steps // 2), keep_last=1, tensorboard=False,
                       progress=progress, log_samples_every=0, plots=False)
  with SFTTrainer(sft, model, train_data=read_jsonl(out / "data" / "sft_train.jsonl"),
                  tokenizer=tokenizer, run_dir=run_dir, run_options=options) as trainer:
    history = trainer.train()
    if history.preempted:
      raise KeyboardInterrupt(f"SFT interrupted by {history.preempted}; run again to resume.")
    trainer.export(hf)
  return hf


# -- evaluation -----------------------------------------------------------------------------------


def accuracy(model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int, samples: int = 0,
             temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
  """Exact-match accuracy of `model` (a `CausalLM`) on `prompts` and its mean response length in
  tokens: of greedy decoding (`samples=0`), or the mean over `samples` responses per prompt drawn
  at `temperature` (the expected reward of the sampling policy; the same draws for every model at
  one `seed`)."""
  import jax
  import numpy as np

  from jax_ppo.rewards.arithmetic import exact_match
  from jax_ppo.rollout.config import SamplingConfig
  from jax_ppo.rollout.sampler import Sampler

  sampler = Sampler(model, SamplingConfig(
      max_new_tokens=max_new_tokens, greedy=samples == 0, temperature=temperature,
      stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id))
  prompts = list(prompts) * max(samples, 1)
  ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
  rollout = sampler(ids, jax.random.key(seed))
  response_ids = np.asarray(rollout.response_ids)
  mask = np.asarray(rollout.response_mask).astype(bool)
  texts = [tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
           for r, m in zip(response_ids, mask, strict=True)]
  return {"accuracy": float(np.mean(exact_match(prompts, texts))),
          "response_length": float(mask.sum(1).mean())}


# -- RL -------------------------------------------------------------------------------------------


def rl_config(cfg: RLVRConfig, algorithm: str, out: pathlib.Path, policy: pathlib.Path,
              tokenizer) -> dict[str, Any]:
  """The `jax-ppo train` config (a mapping) of one algorithm (`ALGORITHMS`)."""
  from jax_ppo.runs.ppo_config import merge_nested

  batch = cfg.prompts_per_update * cfg.n_samples
  shared = {
      "policy_path": str(policy), "prompts_path": str(out / "data" / "rl.jsonl"),
      "reward_function": "arithmetic_exact_match", "run_dir": str(out / algorithm),
      "compilation_cache_dir": "auto",
      "run": {"save_every": max(1, cfg.updates // 2), "keep_last": 1, "tensorboard": False,
              "progress": False, "plots": False, "log_samples_every": 0},
      "ppo": {"batch_size": batch, "n_samples": cfg.n_samples, "num_minibatches": 2,
              "ppo_epochs": cfg.ppo_epochs, "total_updates": cfg.updates, "seed": cfg.seed,
              "reward_clip": None, "whiten_advantages": False,
              "sampling": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                           "stop_token_ids": [tokenizer.eos_token_id],
                           "pad_token_id": tokenizer.pad_token_id},
              "optimizer": {"learning_rate": cfg.learning_rate, "lr_schedule": "constant"}},
  }
  if ALGORITHMS[algorithm]["ppo"]["advantage_mode"] == "gae":
    shared["ppo"]["n_samples"] = 1
  return merge_nested(shared, ALGORITHMS[algorithm])


def online_dpo_config(cfg: RLVRConfig, out: pathlib.Path, policy: pathlib.Path,
                      tokenizer) -> dict[str, Any]:
  """The `jax-ppo dpo` config (a mapping) of online DPO: two samples per prompt, the exact-match
  reward picks chosen and rejected, `prompts_per_update * n_samples / 2` prompts per step so a
  step samples as many responses as the others' updates."""
  return {
      "model_path": str(policy), "prompts_path": str(out / "data" / "rl.jsonl"),
      "reward_function": "arithmetic_exact_match", "run_dir": str(out / "online_dpo"),
      "export_dir": str(out / "online_dpo" / "hf"), "compilation_cache_dir": "auto",
      "run": {"save_every": max(1, cfg.updates // 2), "keep_last": 1, "tensorboard": False,
              "progress": False},
      "dpo": {"batch_size": cfg.prompts_per_update * cfg.n_samples // 2, "n_samples": 2,
              "total_steps": cfg.updates, "beta": 0.1, "seed": cfg.seed,
              "sampling": {"max_new_tokens": cfg.max_new_tokens,
                           "temperature": cfg.temperature},
              "optimizer": {"learning_rate": cfg.learning_rate, "lr_schedule": "constant",
                            "warmup_steps": 0}},
  }


STAGES = (*ALGORITHMS, "online_dpo")
"""Every algorithm the script trains: `ALGORITHMS` (PPO-stage runs) and online DPO."""


def last_metrics(run_dir: pathlib.Path) -> dict[str, Any]:
  """The last row of a run's `metrics.jsonl`."""
  rows = read_jsonl(run_dir / "metrics.jsonl")
  return rows[-1] if rows else {}


def stage_rl(cfg: RLVRConfig, algorithm: str, out: pathlib.Path, policy: pathlib.Path,
             tokenizer) -> dict[str, Any]:
  """Trains `policy` with `algorithm` (`STAGES`); returns its last update's KL and training
  score and the wall time."""
  from jax_ppo.config_io import config_from_dict
  from jax_ppo.runs.dpo import DPORunConfig, run_dpo
  from jax_ppo.runs.ppo import export_run, run_training
  from jax_ppo.runs.ppo_config import RunConfig

  run_dir = out / algorithm
  hf = run_dir / "hf"
  record_path = run_dir / "rlvr.json"
  if (hf / "config.json").exists() and record_path.exists():
    return json.loads(record_path.read_text())
  start = time.perf_counter()
  if algorithm == "online_dpo":
    values = online_dpo_config(cfg, out, policy, tokenizer)
    run_dpo(config_from_dict(DPORunConfig, values))
  else:
    values = rl_config(cfg, algorithm, out, policy, tokenizer)
    run_training(config_from_dict(RunConfig, values))
    export_run(str(run_dir), str(hf))
  wall = time.perf_counter() - start
  last = last_metrics(run_dir)
  record = {"algorithm": algorithm, "wall_s": wall, "updates": cfg.updates,
            "kl": last.get("objective/kl"), "train_score": last.get("objective/scores"),
            "config": values}
  record_path.write_text(json.dumps(record, indent=2) + "\n")
  return record


# -- report ---------------------------------------------------------------------------------------


def table(summary: Mapping[str, Any]) -> str:
  """The Markdown table of the summary: one row per algorithm."""
  sft = summary["sft"]
  lines = ["| algorithm | held-out exact match | RL prompts' exact match | "
           "RL prompts' exact match, sampled | KL to SFT (last update) | response tokens | "
           "RL wall time (s) |",
           "|---|---|---|---|---|---|---|",
           f"| SFT model (start) | {sft['accuracy']:.3f} | {sft['train_accuracy']:.3f} | "
           f"{sft['train_sampled_accuracy']:.3f} | - | {sft['response_length']:.1f} | - |"]
  for name, r in summary["algorithms"].items():
    kl = "-" if r.get("kl") is None else f"{r['kl']:.3f}"
    lines.append(f"| {name} | {r['accuracy']:.3f} | {r['train_accuracy']:.3f} | "
                 f"{r['train_sampled_accuracy']:.3f} | {kl} | {r['response_length']:.1f} | "
                 f"{r['wall_s']:.0f} |")
  return "\n".join(lines)


def run(cfg: RLVRConfig, out: str | os.PathLike, algorithms: Sequence[str], *,
        progress: bool = True) -> dict[str, Any]:
  """Every stage (module docstring); returns the summary written to `out/summary.json`."""
  from jax_ppo.compile_cache import enable_compilation_cache
  from jax_ppo.models import from_pretrained
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from benchmarks.host import host_record

  enable_compilation_cache("auto")
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  tokenizer = stage_data(cfg, out)
  sft = stage_sft(cfg, out, tokenizer, progress=progress)
  held_out = [r["prompt"] for r in read_jsonl(out / "data" / "eval.jsonl")]
  seen = [r["prompt"] for r in read_jsonl(out / "data" / "rl.jsonl")]

  def evaluate(model_dir: pathlib.Path) -> dict[str, float]:
    """Held-out accuracy and length, and the greedy and sampled accuracy on the RL prompts, of
    the model in `model_dir` (loaded once)."""
    model = from_pretrained(str(model_dir))
    held = accuracy(model, tokenizer, held_out, max_new_tokens=cfg.max_new_tokens)
    train = accuracy(model, tokenizer, seen, max_new_tokens=cfg.max_new_tokens)
    sampled = accuracy(model, tokenizer, seen, max_new_tokens=cfg.max_new_tokens,
                       samples=cfg.eval_samples, temperature=cfg.temperature, seed=cfg.seed)
    return {**held, "train_accuracy": train["accuracy"],
            "train_sampled_accuracy": sampled["accuracy"]}

  summary = {"config": dataclasses.asdict(cfg), "host": host_record(), "sft": evaluate(sft),
             "algorithms": {}}
  for name in algorithms:
    record = stage_rl(cfg, name, out, sft, tokenizer)
    summary["algorithms"][name] = {**record, **evaluate(out / name / "hf")}
    print(f"{name}: {summary['algorithms'][name]['accuracy']:.3f}", file=sys.stderr, flush=True)
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/rlvr")
  parser.add_argument("--algorithms", default=",".join(STAGES))
  parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
  parser.add_argument("--fresh", action="store_true", help="delete --out first")
  for f in dataclasses.fields(RLVRConfig):
    parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                        type=type(f.default))
  args = parser.parse_args(argv)
  algorithms = [a for a in args.algorithms.split(",") if a]
  unknown = [a for a in algorithms if a not in STAGES]
  if unknown:
    parser.error(f"--algorithms: unknown {unknown}; choose from {list(STAGES)}")
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(RLVRConfig)
               if getattr(args, f.name) is not None}
  try:
    cfg = smoke(**overrides) if args.smoke else RLVRConfig(**overrides)
  except ValueError as e:
    parser.error(str(e))
  if args.fresh:
    shutil.rmtree(args.out, ignore_errors=True)
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  summary = run(cfg, args.out, algorithms, progress=not args.smoke)
  print(table(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
