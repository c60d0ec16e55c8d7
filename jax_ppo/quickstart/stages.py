"""The quickstart's stages: data, SFT, preference pairs, reward model, PPO.

Each stage writes into its own sub-folder of the output folder and is skipped when its result is
already there (a finished stage leaves `hf/config.json` or its data files, written under a
temporary name and renamed at the end; the models by `jax_ppo.training.export`), so running the
same command again resumes. SFT, the reward model and PPO train in `RunLoop` run folders and
resume mid-stage from their latest checkpoint.

Layout of `out/`::

    config.json            the QuickstartConfig
    data/                  tokenizer/, train.jsonl, eval.jsonl (prompt, response)
    sft/                   run folder (metrics.jsonl, checkpoints/, config.yaml), hf/ (policy)
    pairs/                 train.jsonl, eval.jsonl (prompt, chosen, rejected), sft_samples.jsonl
    reward_model/          run folder, hf/ (normalised *ForSequenceClassification)
    ppo/                   run folder (metrics.jsonl, samples.jsonl, checkpoints/), hf/ (policy)
    metrics.jsonl          one record per evaluation: {stage, step, ...}
    samples.jsonl          {stage, step, prompt, response, reward, gold} per sampled response
    plots/                 PNG plots
    timings.json           seconds per stage, per invocation
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import tqdm
from flax import nnx

from jax_ppo.data.prompts import PromptDataset
from jax_ppo.models import (
  CausalLM,
  ModelConfig,
  from_pretrained,
  load_scalar_model,
  pad_batch,
  value_model_from_reward_model,
)
from jax_ppo.quickstart import reviews
from jax_ppo.quickstart.config import QuickstartConfig
from jax_ppo.quickstart.tokenizer_training import train_bpe_tokenizer
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler
from jax_ppo.training.loop import RunOptions

logger = logging.getLogger("jax_ppo.quickstart")


# -- small file helpers -------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a JSON-lines file ([] when it does not exist)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> None:
  """Writes `records` to `path` atomically (a temporary file renamed over it)."""
  path = pathlib.Path(path)
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def append_jsonl(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> None:
  with pathlib.Path(path).open("a") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")


def replace_stage_records(path: str | os.PathLike, stage: str,
                          records: Sequence[dict[str, Any]]) -> None:
  """Appends `records` to a JSON-lines file after dropping its earlier records of `stage` (a
  stage redone after an interruption does not duplicate them)."""
  kept = [r for r in read_jsonl(path) if r.get("stage") != stage]
  write_jsonl(path, [*kept, *records])


def _finished(hf_dir: pathlib.Path) -> bool:
  return (hf_dir / "config.json").exists()


def clean_text(tokenizer, text: str) -> str:
  """`text` without the tokenizer's special tokens (decoded rollouts keep them)."""
  for tok in tokenizer.all_special_tokens:
    text = text.replace(tok, "")
  return text


def _run_options(save_every: int, **kw) -> RunOptions:
  return RunOptions(save_every=max(1, save_every), keep_last=2, tensorboard=False, **kw)


# -- stage 1: corpus and tokenizer --------------------------------------------------------------


def stage_data(cfg: QuickstartConfig, out: pathlib.Path):
  """The corpus (train/held-out records) and the BPE tokenizer, from `out/data` when there."""
  from transformers import AutoTokenizer

  d = out / "data"
  tok_dir = d / "tokenizer"
  if (d / "eval.jsonl").exists() and tok_dir.exists():
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True,
                                        trust_remote_code=False)
    return tok, read_jsonl(d / "train.jsonl"), read_jsonl(d / "eval.jsonl"), True
  d.mkdir(parents=True, exist_ok=True)
  corpus = reviews.make_corpus(cfg.corpus_size, seed=cfg.seed)
  train, held = reviews.split(corpus, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
  tok = train_bpe_tokenizer([r.text for r in train], vocab_size=cfg.vocab_size)
  shutil.rmtree(tok_dir, ignore_errors=True)
  tok.save_pretrained(str(tok_dir))
  records = [[{"prompt": r.prompt, "response": r.response} for r in part]
             for part in (train, held)]
  write_jsonl(d / "train.jsonl", records[0])
  write_jsonl(d / "eval.jsonl", records[1])  # written last: marks the stage done
  return tok, records[0], records[1], False


def model_config(cfg: QuickstartConfig, tokenizer) -> ModelConfig:
  """The tiny decoder: random init, the tokenizer's vocabulary and special ids."""
  return ModelConfig(
      model_type=cfg.model_type, vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      max_position_embeddings=max(cfg.max_length, 16 + cfg.max_new_tokens) * 2,
      qk_norm=cfg.model_type == "qwen3", tie_word_embeddings=True,
      bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id,
  )


# -- stage 2: SFT --------------------------------------------------------------------------------


def stage_sft(cfg: QuickstartConfig, out: pathlib.Path, tokenizer, train: list[dict],
              held: list[dict], *, progress: bool = True) -> tuple[pathlib.Path, dict | None]:
  """Trains the random-init model by SFT on the reviews; returns `(hf folder, eval metrics)`
  (None when the stage was already done)."""
  from jax_ppo.sft import SFTConfig, SFTOptimizer, SFTTrainer

  run_dir = out / "sft"
  hf = run_dir / "hf"
  if _finished(hf):
    return hf, None
  model = CausalLM(model_config(cfg, tokenizer), rngs=nnx.Rngs(cfg.seed))
  sft_config = SFTConfig(
      max_length=cfg.max_length, batch_size=cfg.sft_batch_size, total_steps=cfg.sft_steps,
      eval_every=cfg.sft_eval_every, seed=cfg.seed,
      optimizer=SFTOptimizer(learning_rate=cfg.sft_learning_rate, lr_schedule="cosine",
                             warmup_steps=min(20, cfg.sft_steps // 10)),
  )
  with SFTTrainer(sft_config, model, train_data=train, eval_data=held, tokenizer=tokenizer,
                  run_dir=run_dir, run_options=_run_options(cfg.sft_steps // 4, progress=progress,
                                                            log_samples_every=0)) as trainer:
    history = trainer.train()
    if history.preempted:
      raise KeyboardInterrupt(f"SFT interrupted by {history.preempted}; run again to resume.")
    metrics = trainer.evaluate()
    trainer.export(hf)  # atomic: hf/ appears only when complete (jax_ppo.training.export)
  replace_stage_records(out / "metrics.jsonl", "sft", [{"stage": "sft", "step": cfg.sft_steps,
                                                        **metrics}])
  return hf, metrics


# -- stage 3: preference pairs -------------------------------------------------------------------


def review_prompts(n: int, *, seed: int) -> list[str]:
  """`n` review openings cycling over the products in a seeded order."""
  order = np.random.default_rng(seed).permutation(len(reviews.PRODUCTS))
  return [reviews.prompt_for(reviews.PRODUCTS[order[i % len(order)]]) for i in range(n)]


def encode_prompts(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
  return [list(tokenizer(p)["input_ids"]) for p in prompts]


def sample_texts(policy, tokenizer, prompts: Sequence[str], *, cfg: QuickstartConfig,
                 n_samples: int, seed: int, chunk_size: int = 128,
                 progress: bool = True) -> list[list[str]]:
  """`n_samples` sampled responses (special tokens removed) per prompt, sampled `chunk_size`
  prompts at a time (chunk `i` with key `fold_in(key(seed), i)`)."""
  sampling = SamplingConfig(
      max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
      stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id,
      n_samples=n_samples,
  )
  sampler = Sampler(policy, sampling)
  ids = encode_prompts(tokenizer, prompts)
  texts = []
  starts = range(0, len(prompts), chunk_size)
  for i, start in enumerate(tqdm.tqdm(starts, desc="sample", unit="batch", disable=not progress)):
    rollout = sampler(ids[start:start + chunk_size], jax.random.fold_in(jax.random.key(seed), i))
    response_ids = np.asarray(rollout.response_ids)
    mask = np.asarray(rollout.response_mask).astype(bool)
    texts.extend(tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
                 for r, m in zip(response_ids, mask, strict=True))
  return [texts[k * n_samples:(k + 1) * n_samples] for k in range(len(prompts))]


def stage_pairs(cfg: QuickstartConfig, out: pathlib.Path, tokenizer, sft_hf: pathlib.Path, *,
                progress: bool = True):
  """Two SFT-policy samples per prompt, labelled by the gold scorer plus noise, and
  `hack_pair_fraction` as many pairs of a sample against a degenerate rewrite of it
  (`reviews.corrupt`); returns
  `(train pairs, eval pairs, sft samples [{prompt, response}], skipped)`."""
  d = out / "pairs"
  if (d / "eval.jsonl").exists():
    return (read_jsonl(d / "train.jsonl"), read_jsonl(d / "eval.jsonl"),
            read_jsonl(d / "sft_samples.jsonl"), True)
  d.mkdir(parents=True, exist_ok=True)
  policy = from_pretrained(str(sft_hf))
  prompts = review_prompts(cfg.pair_prompts, seed=cfg.seed + 1)
  samples = sample_texts(policy, tokenizer, prompts, cfg=cfg, n_samples=2, seed=cfg.seed + 2,
                         progress=progress)
  pairs = reviews.label_pairs(prompts, [s[0] for s in samples], [s[1] for s in samples],
                              temperature=cfg.label_temperature, seed=cfg.seed + 3)
  # Extra pairs (sample, degenerate rewrite of it), labelled the same way: the reward model
  # sees the repetition / adjective-list / truncation hacks the gold score refuses.
  rng = np.random.default_rng(cfg.seed + 6)
  n_hacks = round(cfg.hack_pair_fraction * len(prompts))
  picks = rng.choice(len(prompts), size=n_hacks, replace=n_hacks > len(prompts))
  originals = [samples[i][0] for i in picks]
  pairs += reviews.label_pairs([prompts[i] for i in picks], originals,
                               [reviews.corrupt(t, rng) for t in originals],
                               temperature=cfg.label_temperature, seed=cfg.seed + 8)
  if len(pairs) < 4:
    raise RuntimeError(
        f"Only {len(pairs)} of {cfg.pair_prompts} prompt's two SFT samples differ; the SFT "
        "policy is (nearly) deterministic: raise temperature or pair_prompts."
    )
  train, held = reviews.split(pairs, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
  flat = [{"prompt": p, "response": r} for p, s in zip(prompts, samples, strict=True) for r in s]
  gold = reviews.gold_scores([f["response"] for f in flat])
  replace_stage_records(out / "samples.jsonl", "sft", [
      {"stage": "sft", "step": cfg.sft_steps, **f, "reward": None, "gold": float(g)}
      for f, g in zip(flat, gold, strict=True)
  ])
  write_jsonl(d / "sft_samples.jsonl", flat)
  write_jsonl(d / "train.jsonl", train)
  write_jsonl(d / "eval.jsonl", held)  # written last: marks the stage done
  return train, held, flat, False


# -- stage 4: reward model -----------------------------------------------------------------------


def sequences(tokenizer, records: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded `<bos> prompt response <eos>` ids and masks, as the reward model is trained."""
  seqs = [list(tokenizer(r["prompt"])["input_ids"])
          + list(tokenizer(r["response"], add_special_tokens=False)["input_ids"])
          + [tokenizer.eos_token_id] for r in records]
  return pad_batch(seqs, pad_token_id=tokenizer.pad_token_id, side="right")


def hack_probe(trainer, tokenizer, samples: Sequence[dict], *, seed: int,
               limit: int = 64) -> dict[str, float]:
  """For each `reviews.CORRUPTIONS` kind: the share of clearly positive samples (gold > 0.5; at
  most `limit`) whose degenerate rewrite the reward model scores higher than the sample (the
  gold score ranks every such rewrite lower; 0 is the ideal). Empty without positive samples."""
  good = [s for s in samples if reviews.gold_score(s["response"]) > 0.5][:limit]
  if not good:
    return {}
  rng = np.random.default_rng(seed)
  base = trainer.score(*sequences(tokenizer, good))
  out = {}
  for kind in reviews.CORRUPTIONS:
    rewrites = [{"prompt": s["prompt"], "response": reviews.corrupt(s["response"], rng, kind)}
                for s in good]
    out[f"hack_probe/{kind}"] = float(np.mean(trainer.score(*sequences(tokenizer, rewrites))
                                              > base))
  return out


def stage_reward(cfg: QuickstartConfig, out: pathlib.Path, tokenizer, sft_hf: pathlib.Path,
                 train: list[dict], held: list[dict], sft_samples: list[dict], *,
                 progress: bool = True) -> tuple[pathlib.Path, dict | None]:
  """Bradley-Terry reward model on the SFT trunk, normalised on SFT samples (mean 0, std 1)."""
  from jax_ppo.reward_model import RewardModelConfig, RewardModelOptimizer, RewardModelTrainer

  run_dir = out / "reward_model"
  hf = run_dir / "hf"
  if _finished(hf):
    return hf, None
  model = load_scalar_model(str(sft_hf), seed=cfg.seed)
  rm_config = RewardModelConfig(
      max_length=cfg.max_length, batch_size=cfg.rm_batch_size, total_steps=cfg.rm_steps,
      eval_every=cfg.rm_eval_every, seed=cfg.seed,
      optimizer=RewardModelOptimizer(learning_rate=cfg.rm_learning_rate,
                                     warmup_steps=min(20, cfg.rm_steps // 10)),
  )
  with RewardModelTrainer(rm_config, model, train_data=train, eval_data=held,
                          tokenizer=tokenizer, run_dir=run_dir,
                          run_options=_run_options(cfg.rm_steps // 4, progress=progress,
                                                   log_samples_every=0)) as trainer:
    history = trainer.train()
    if history.preempted:
      raise KeyboardInterrupt(f"Reward-model training interrupted by {history.preempted}; run "
                              "again to resume.")
    metrics = trainer.evaluate()
    ids, mask = sequences(tokenizer, sft_samples)
    norm = trainer.normalise(input_ids=ids, attention_mask=mask)
    metrics.update(hack_probe(trainer, tokenizer, sft_samples, seed=cfg.seed + 9))
    trainer.export(hf)  # atomic: hf/ appears only when complete (jax_ppo.training.export)
  metrics = {**metrics, **{f"normalisation/{k}": v for k, v in norm.items()}}
  replace_stage_records(out / "metrics.jsonl", "reward_model",
                        [{"stage": "reward_model", "step": cfg.rm_steps, **metrics}])
  return hf, metrics


# -- stage 5: PPO --------------------------------------------------------------------------------


def ppo_config(cfg: QuickstartConfig, tokenizer):
  from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling

  return PPOConfig(
      batch_size=cfg.ppo_batch_size, num_minibatches=cfg.ppo_minibatches,
      ppo_epochs=cfg.ppo_epochs,
      sampling=PPOSampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                           stop_token_ids=(tokenizer.eos_token_id,),
                           pad_token_id=tokenizer.pad_token_id),
      missing_eos_penalty=cfg.missing_eos_penalty,
      optimizer=PPOOptimizer(learning_rate=cfg.ppo_learning_rate, lr_schedule="linear"),
      kl_coef=cfg.kl_coef, total_updates=cfg.ppo_updates,
      vf_coef=0.5, seed=cfg.seed,
  )


def evaluate_policy(trainer, tokenizer, prompts: Sequence[str], *, cfg: QuickstartConfig,
                    step: int) -> tuple[dict[str, float], list[dict]]:
  """Samples `prompts` with the current policy, scores them with the reward model and the gold
  scorer; returns `(metrics, sample records)`. The samples use a fixed key, so step 0 (the SFT
  policy) and later steps answer the same prompts under the same randomness."""
  metrics, samples = trainer.evaluate_with_samples(
      encode_prompts(tokenizer, prompts), temperature=cfg.temperature, seed=cfg.seed + 7)
  responses = [clean_text(tokenizer, s["response"]) for s in samples]
  gold = reviews.gold_scores(responses)
  stats = reviews.text_stats(responses)
  metrics = {**metrics, **{f"gold/{k}": v for k, v in stats.items()},
             "gold/score_std": float(gold.std()), "eval/samples": float(len(responses))}
  records = [{"stage": "ppo", "step": step, "prompt": p, "response": r,
              "reward": s["reward"], "gold": float(g), "kl": s["kl"]}
             for p, r, s, g in zip(prompts, responses, samples, gold, strict=True)]
  return metrics, records


def _truncate_ppo_records(out: pathlib.Path, step: int) -> None:
  """Drops PPO records after `step` (a resumed run redoes them)."""
  for name in ("metrics.jsonl", "samples.jsonl"):
    path = out / name
    records = read_jsonl(path)
    kept = [r for r in records if r.get("stage") != "ppo" or r["step"] <= step]
    if len(kept) != len(records):
      write_jsonl(path, kept)


def stage_ppo(cfg: QuickstartConfig, out: pathlib.Path, tokenizer, sft_hf: pathlib.Path,
              rm_hf: pathlib.Path, *, progress: bool = True,
              log: Callable[[str], Any] = print) -> pathlib.Path:
  """PPO on the SFT policy with the normalised reward model and KL to the SFT model; evaluates
  at step 0 and every `eval_every` updates; exports the policy to `out/ppo/hf`."""
  from jax_ppo.ppo import PPOTrainer

  run_dir = out / "ppo"
  hf = run_dir / "hf"
  if _finished(hf):
    return hf
  policy = from_pretrained(str(sft_hf))
  reward_model = load_scalar_model(str(rm_hf))
  value_model = value_model_from_reward_model(reward_model)
  train_prompts = review_prompts(4 * len(reviews.PRODUCTS), seed=cfg.seed + 4)
  dataset = PromptDataset(encode_prompts(tokenizer, train_prompts), texts=train_prompts,
                          seed=cfg.seed)
  eval_prompts = review_prompts(cfg.eval_samples, seed=cfg.seed + 5)
  config = ppo_config(cfg, tokenizer)
  options = _run_options(cfg.eval_every, progress=progress, log_samples_every=cfg.eval_every,
                         samples_per_log=8)
  with PPOTrainer(config, policy, reward=reward_model, prompts=dataset, tokenizer=tokenizer,
                  value_model=value_model, run_dir=run_dir, run_options=options) as trainer:
    _truncate_ppo_records(out, trainer.step_count)
    done = {r["step"] for r in read_jsonl(out / "metrics.jsonl") if r.get("stage") == "ppo"}
    while True:
      step = trainer.step_count
      if step not in done and (step % cfg.eval_every == 0 or step == cfg.ppo_updates):
        metrics, records = evaluate_policy(trainer, tokenizer, eval_prompts, cfg=cfg, step=step)
        append_jsonl(out / "samples.jsonl", records)
        append_jsonl(out / "metrics.jsonl", [{"stage": "ppo", "step": step, **metrics}])
        done.add(step)
        log(f"[ppo] step {step}: gold score {metrics['gold/gold_score']:+.3f}, reward "
            f"{metrics['eval/score_mean']:+.3f}, KL {metrics['eval/kl']:.2f}, "
            f"distinct-2 {metrics['gold/distinct_2']:.3f}")
      if step >= cfg.ppo_updates:
        break
      trainer.train(min(cfg.eval_every - step % cfg.eval_every, cfg.ppo_updates - step))
      if trainer.preempted:
        raise KeyboardInterrupt(f"PPO interrupted by {trainer.preempted}; run again to resume.")
    trainer.export(hf)  # atomic: hf/ appears only when complete (jax_ppo.training.export)
  return hf


def config_record(cfg: QuickstartConfig) -> dict[str, Any]:
  return dataclasses.asdict(cfg)
