"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's
`OnlineDPOTrainer`): `OnlineDPOTrainer`, the host loop.

Each step takes the next `DPOConfig.batch_size` prompts, samples `DPOConfig.n_samples` responses
to each from the current policy with the compiled sampler (`jax_ppo.rollout.sampler.Sampler`,
`DPOConfig.sampling`), scores them with a reward model or a reward function (the PPO stage's
scorers, `jax_ppo.rewards.scorers`), takes the best scored response of each prompt as the chosen
one and the worst as the rejected one (`jax_ppo.dpo.online_pairs.select_pairs`), and makes one
optimizer step on `jax_ppo.core.dpo_loss` of those pairs against the frozen reference (the
starting weights, a `reference=` model, or with LoRA the base weights): the compiled
`DPOSteps.train_weighted_step`.

Ties: a prompt whose samples all score the same gives a pair without a preference (with a
binary reward, often both samples right or both wrong). Its weight is 0: it is left out of the
loss and of the DPO metrics, which are means over the other pairs (a step whose pairs all tie
makes no gradient; AdamW's momentum and weight decay still move the weights). `objective/ties`
logs their share. TRL keeps such pairs, in an arbitrary order.

Metrics of a step: `train/loss`, TRL's `rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected` (over the untied
pairs), `objective/kl` (mean sequence log-ratio to the reference of the chosen and rejected
responses), and of the scorer: `objective/scores` (mean score of every sample),
`objective/scores_chosen`, `objective/scores_rejected` (mean score of the chosen and of the
rejected responses, ties included), `objective/scores_margin` (their mean difference),
`objective/ties`; `val/contain_eos_token` (share of samples that ended with a stop token),
`reward/<name>` per source of a `CombinedScorer`, the gradient norm, learning rate, skipped
updates and timings.

Resume: the prompts of step `s` are batch `s` of the `PromptDataset` (its order depends only on
the position) and the sampling key is `fold_in(PRNGKey(seed + 1), s)`, so a run resumed from a
checkpoint reproduces the uninterrupted one. The DPO loss reads the policy's distribution at
temperature 1 (as TRL's), whatever `sampling.temperature` the responses were drawn with.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.data.prompts import PromptDataset
from jax_ppo.dpo.config import DPOConfig
from jax_ppo.dpo.online_pairs import rollout_pairs, select_pairs
from jax_ppo.dpo.steps import DPOSteps, split_trainable
from jax_ppo.dpo.trainer import reference_params
from jax_ppo.models.lora import has_lora
from jax_ppo.parallel import host_rows
from jax_ppo.parallel.distributed import multi_process
from jax_ppo.rewards.scorers import CombinedScorer, as_scorer
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler
from jax_ppo.training.export import export_pretrained
from jax_ppo.training.loop import RunLoop, RunOptions, StepAbandoned
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.stage import RunStage
from jax_ppo.training.state import StageState, init_stage_state, place_stage_state

SCORE_METRICS = ("objective/scores", "objective/scores_chosen", "objective/scores_rejected",
                 "objective/scores_margin", "objective/ties", "val/contain_eos_token")
"""The scorer's metrics of an online DPO step (see the module docstring)."""


def sampler_ids(config: DPOConfig, tokenizer: Any, model_eos: Sequence[int]
                ) -> tuple[int, tuple[int, ...]]:
  """`(pad id, stop ids)` of the sampler: the pad id is `config.pad_token_id`, else the
  tokenizer's, else `config.sampling.pad_token_id`; the stop ids are
  `config.sampling.stop_token_ids`, else `config.eos_token_id`, the tokenizer's EOS and the
  model's EOS ids (`model_eos`), without the pad id."""
  tok_pad = getattr(tokenizer, "pad_token_id", None)
  pad = config.pad_token_id if config.pad_token_id is not None else (
      tok_pad if tok_pad is not None else config.sampling.pad_token_id)
  if config.sampling.stop_token_ids:
    return pad, tuple(config.sampling.stop_token_ids)
  eos = (config.eos_token_id, getattr(tokenizer, "eos_token_id", None), *model_eos)
  return pad, tuple(dict.fromkeys(int(i) for i in eos if i is not None and i != pad))


class OnlineDPOTrainer(RunStage):
  """Trains a causal LM with online DPO on prompts, scored by a reward model or function.

  Args:
    config: the run's `DPOConfig` (`batch_size` prompts per step, `n_samples` responses each,
      `sampling`; `precompute_reference` and `eval_fraction` are offline only and must stay
      off).
    model: the policy, a `jax_ppo.models.CausalLM` (with LoRA adapters only they train, and the
      reference is the base).
    reward: a `ScalarModel` reward model, a scorer (`jax_ppo.rewards.scorers`: a
      `RewardModelScorer`, `FunctionScorer`, `TokenScorer` or `CombinedScorer`), or a Python
      function `fn(prompts, responses) -> scores` (texts with a tokenizer, else token ids).
    prompts: a `PromptDataset`, or token-id prompts (shuffled with `config.seed`).
    tokenizer: the policy's tokenizer (text rewards, EOS/pad ids, export).
    reference: the reference model; None: the policy's starting weights. Not with LoRA.
    run_dir, run_options, run_config: the run folder, as `DPOTrainer`'s.
    mesh: a device mesh (one process); None: one device.

  Attributes:
    last_scores: `[P, n]` host float32 scores of the last step's samples (None before).
    last_pairs: `(chosen [P], rejected [P], tie [P])` of the last step (`select_pairs`).
  """

  CHECKPOINT_STAGE = "online_dpo"

  def __init__(
      self,
      config: DPOConfig,
      model: nnx.Module,
      *,
      reward: Any,
      prompts: PromptDataset | Sequence[Sequence[int]],
      tokenizer: Any = None,
      reference: nnx.Module | None = None,
      run_dir: str | os.PathLike | None = None,
      run_options: RunOptions | None = None,
      run_config: Any = None,
      mesh: Mesh | None = None,
  ):
    if multi_process():
      raise ValueError("Online DPO runs in one process (its sampled pairs are not yet split over "
                       "processes); run it without a multi-process job, on a mesh of this "
                       "process's devices.")
    self.config = c = config
    if c.precompute_reference:
      raise ValueError("DPOConfig.precompute_reference=True is invalid for online DPO: its pairs "
                       "are sampled at every step, so no reference log-probs can be cached; set "
                       "it to false.")
    if c.eval_fraction:
      raise ValueError(f"DPOConfig.eval_fraction={c.eval_fraction} is invalid for online DPO: it "
                       "holds out preference pairs, and online DPO reads prompts; set it to 0.")
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.lora = has_lora(model)
    if self.lora and reference is not None:
      raise ValueError("A LoRA policy's reference is its base weights (adapters off): drop "
                       "reference= (DPORunConfig.reference_path), or train without LoRA.")
    self.prompts = prompts if isinstance(prompts, PromptDataset) else PromptDataset(
        prompts, seed=c.seed)
    self.scorer: Callable = as_scorer(reward, tokenizer)
    self.reward_state = getattr(self.scorer, "state", None)
    pad, stops = sampler_ids(c, tokenizer, model.config.eos_token_ids)
    self.sampling = SamplingConfig.from_params(
        c.sampling, n_samples=c.n_samples, batch_buckets=(c.batch_size,), pad_token_id=pad,
        stop_token_ids=stops)
    self.total_steps = c.total_steps or c.num_epochs * -(-len(self.prompts) // c.batch_size)
    c.check_warmup(self.total_steps)
    graphdef, params, self.rest = split_trainable(model, scan_layers=c.train_scan_layers)
    self.ref: Any = reference_params(params, reference, lora=self.lora,
                                     scan_layers=c.train_scan_layers)
    self.optimizer, self.schedule = make_optimizer(c.optimizer, self.total_steps)
    self.steps = DPOSteps(c, graphdef=graphdef, lora=self.lora, optimizer=self.optimizer,
                          schedule=self.schedule, mesh=mesh)
    self.sampler = Sampler(model, self.sampling, mesh=mesh)
    state = init_stage_state(self.optimizer, params)
    self.state: StageState
    self.state, self.rest, self.ref = place_stage_state(state, mesh, self.rest, self.ref)
    self._sample_key = jax.random.PRNGKey(c.seed + 1)
    self.cut_records: dict[str, int] = {}  # (no records are cut: prompts are checked whole)
    self.last_scores: np.ndarray | None = None
    self.last_pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    self.run = RunLoop(
        self, None if run_dir is None else pathlib.Path(run_dir),
        options=run_options if run_options is not None else RunOptions(log_samples_every=0),
        run_config=run_config if run_config is not None else config, total_steps=self.total_steps,
        max_consecutive_skips=c.max_consecutive_skips,
        progress_metrics=(("loss", "train/loss"), ("score", "objective/scores"),
                          ("ties", "objective/ties")),
        progress_desc="online dpo",
    )

  def policy_state(self) -> tuple[nnx.State, nnx.State]:
    """The sampler's view of the policy: `(trainable, rest)`."""
    return (self.state.params, self.rest)

  def step(self) -> dict[str, float]:
    """One online DPO step: sample, score, pick the pairs, one optimizer step."""
    c = self.config
    t_start = time.perf_counter()
    prompt_ids, _ = self.prompts.batch(self.step_count, c.batch_size)
    key = jax.random.fold_in(self._sample_key, self.step_count)
    rollout = self.sampler(prompt_ids, key, state=self.policy_state())
    jax.block_until_ready(rollout.response_ids)
    t_rollout = time.perf_counter()
    scores = np.asarray(host_rows.gathered(self.scorer(rollout, self.reward_state)), np.float32)
    t_score = time.perf_counter()
    if self.run.stop_requested:  # preempted: nothing has changed yet
      raise StepAbandoned
    p, n = len(prompt_ids), c.n_samples
    scores_pn = scores.reshape(p, n)
    chosen, rejected, tie = select_pairs(scores_pn)
    rows = np.arange(p) * n
    pairs = rollout_pairs(rollout, rows + chosen, rows + rejected)
    weight = jnp.asarray(~tie, jnp.float32)
    self.state, metrics = self.steps.train_weighted_step(self.state, self.rest, self.ref, pairs,
                                                         weight)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    t_end = time.perf_counter()
    best = scores_pn[np.arange(p), chosen]
    worst = scores_pn[np.arange(p), rejected]
    metrics.update({
        "objective/scores": float(scores.mean()),
        "objective/scores_chosen": float(best.mean()),
        "objective/scores_rejected": float(worst.mean()),
        "objective/scores_margin": float((best - worst).mean()),
        "objective/ties": float(tie.mean()),
        "val/contain_eos_token": float(np.mean(np.asarray(rollout.has_stop))),
        "time/rollout_s": t_rollout - t_start,
        "time/score_s": t_score - t_rollout,
        "time/update_s": t_end - t_score,
    })
    if isinstance(self.scorer, CombinedScorer):  # each source's raw score, `reward/<name>`
      metrics.update(self.scorer.metrics())
    self.last_scores, self.last_pairs = scores_pn, (chosen, rejected, tie)
    return metrics

  # -- export -------------------------------------------------------------------------------

  def model(self) -> nnx.Module:
    """The current policy as an NNX module."""
    return nnx.merge(self.steps.graphdef, self.state.params, self.rest)

  def export(self, path: str | os.PathLike, *, dtype=None,
             max_shard_size: int | str | None = "5GB") -> pathlib.Path:
    """Writes the policy as a Hugging Face causal-LM folder (LoRA merged) with the tokenizer,
    atomically (`jax_ppo.training.export.export_pretrained`)."""
    return export_pretrained(self.model(), path, tokenizer=self.tokenizer, dtype=dtype,
                             max_shard_size=max_shard_size)


__all__ = ["SCORE_METRICS", "OnlineDPOTrainer", "sampler_ids"]
