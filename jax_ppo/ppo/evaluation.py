"""Evaluation on held-out prompts: the metrics of `jax-ppo eval` and the run loop's hook that
logs them during training.

`evaluate_prompts(trainer, prompts, n=..., temperature=..., seed=...)` samples every prompt `n`
times with the trainer's current policy (`PPOTrainer.evaluate_with_samples`), scores the
samples with the run's reward, and returns `(metrics, samples)`: `eval/score_mean`,
`eval/score_std`, `eval/best_of_n` (the best of each prompt's `n` scores, averaged over prompts),
`eval/kl` (sum over response tokens of log pi - log pi_ref, mean over samples), `eval/entropy`,
`eval/response_length` (tokens), `eval/distinct_1` and `eval/distinct_2` (unique / all word
n-grams over all responses), `eval/repetition_rate`, `eval/n` (`jax_ppo.ppo.eval_metrics`) and,
with a combined reward (`CombinedScorer`), `eval/reward/<name>`, each source's mean raw score.
`jax_ppo.runs.ppo.evaluate_run` (a checkpoint of a finished run) and `HeldOutEvalHook` (the
policy during training) both call it.

`HeldOutEvalHook` is a `jax_ppo.training.hooks.LoopHook`: after every `HeldOutEval.every`-th
update and after the last one it evaluates `HeldOutEval.prompts` and adds the metrics to that
update's, so the run loop logs them at that step (`metrics.jsonl`, TensorBoard, W&B) and keeps
them in the returned history. Evaluation leaves training unchanged: it samples with its own key
(`PRNGKey(HeldOutEval.seed)`, folded with the chunk index; the same at every evaluation, so two
evaluations differ only by the policy), while the rollout key of update `k` is
`fold_in(PRNGKey(PPOConfig.seed + 1), k)` whatever ran before; it reads the `TrainState` and
changes nothing in it. It has no state of its own: a resumed run evaluates at the same steps
(one evaluated before a preemption but after the last checkpoint is evaluated again). Several
processes: every process samples and scores all prompts (the rows split over the mesh), as
`evaluate_run` does; process 0's logger writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from jax_ppo.ppo.eval_metrics import best_of_n, distinct_n, repetition_rate
from jax_ppo.rewards.scorers import CombinedScorer

logger = logging.getLogger(__name__)


class Evaluated(Protocol):
  """What an evaluation needs of its trainer (a `jax_ppo.ppo.trainer.PPOTrainer`, which holds the
  evaluation hook: this module does not import it): the reward it scores with (`scorer`, swapped
  for the evaluation's while it runs) and `evaluate_with_samples`."""

  scorer: Any

  def evaluate_with_samples(self, prompts: Sequence[Sequence[int]], *,
                            temperature: float | None = None,
                            seed: int = 0) -> tuple[dict[str, float], list[dict[str, Any]]]: ...


def check_eval_sampling(n: Any, temperature: float | None, *, n_field: str,
                        temperature_field: str) -> None:
  """ValueError naming `n_field` unless `n` is an int >= 1, and unless `n` is 1 when
  `temperature` is None (greedy samples are identical); naming `temperature_field` unless
  `temperature` is None or a number > 0. Shared by `evaluate_run`, `RunConfig.eval_n` /
  `eval_temperature` and the pipeline's `eval` section, which checks before any stage trains."""
  if temperature is not None and (isinstance(temperature, bool)
                                  or not isinstance(temperature, int | float)
                                  or not temperature > 0):
    raise ValueError(f"{temperature_field}={temperature!r} is invalid: give a temperature > 0, "
                     "or null to sample greedily.")
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"{n_field}={n!r} is invalid: give the number of samples per prompt (>= 1).")
  if n > 1 and temperature is None:
    raise ValueError(f"{n_field}={n} needs sampling: greedy decoding gives {n} identical "
                     f"responses; give {temperature_field} (e.g. 1.0).")


def check_eval_settings(*, every: Any, seed: Any, n: Any, temperature: float | None,
                        prefix: str) -> None:
  """The schedule and sampling of an evaluation during training: `every` and `seed` ints >= 0,
  and `check_eval_sampling(n, temperature)`; one ValueError naming `prefix + field` (e.g.
  "HeldOutEval.every", "RunConfig.eval_every")."""
  for field, value in (("every", every), ("seed", seed)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{prefix}{field}={value!r} is invalid: use an int >= 0.")
  check_eval_sampling(n, temperature, n_field=f"{prefix}n",
                      temperature_field=f"{prefix}temperature")


@contextlib.contextmanager
def _raw_scores(trainer: Evaluated) -> Iterator[dict[str, list[float]]]:
  """While open, each source's raw scores of a combined reward (`CombinedScorer.last_raw`)
  collected chunk by chunk into the yielded dict (`name -> scores`, in sample order); the
  trainer's scorer is restored on exit. Empty for any other reward."""
  raw: dict[str, list[float]] = {}
  combined = trainer.scorer
  if not isinstance(combined, CombinedScorer):
    yield raw
    return

  def scorer(rollout, reward_state=None):
    scores = combined(rollout, reward_state)
    for name, values in combined.last_raw.items():
      raw.setdefault(name, []).extend(np.asarray(values).tolist())
    return scores

  trainer.scorer = scorer
  try:
    yield raw
  finally:
    trainer.scorer = combined


def evaluate_prompts(
    trainer: Evaluated,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    temperature: float | None = None,
    seed: int = 0,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """Samples each prompt `n` times with the trainer's current policy and scores the samples.

  Args:
    trainer: a `PPOTrainer` (its policy, reward and reference as they are now).
    prompts: `P` token-id prompts.
    n: samples per prompt (best-of-n); more than 1 needs a `temperature`.
    temperature: None samples greedily; else the sampling temperature.
    seed: the sampling key is `PRNGKey(seed)` (folded with the chunk index).

  Returns:
    `(metrics, samples)`: the `eval/...` metrics of the module docstring (host floats) and
    `P * n` records `{prompt, response, reward, length, kl, prompt_index}` in prompt-major order
    (the `n` samples of prompt `p` in a row, `prompt_index` = p), with a combined reward also
    `rewards: {name: raw score}`.
  """
  check_eval_sampling(n, temperature, n_field="n", temperature_field="temperature")
  repeated = [p for p in prompts for _ in range(n)]  # prompt-major: n in a row
  with _raw_scores(trainer) as raw:
    metrics, samples = trainer.evaluate_with_samples(repeated, temperature=temperature,
                                                     seed=seed)
  for i, sample in enumerate(samples):
    sample["prompt_index"] = i // n
    if raw:
      sample["rewards"] = {name: values[i] for name, values in raw.items()}
  metrics.update({f"eval/reward/{name}": float(np.mean(values)) for name, values in raw.items()})
  responses = [s["response"] for s in samples]
  metrics.update({
      "eval/best_of_n": best_of_n([s["reward"] for s in samples], n),
      "eval/n": float(n),
      "eval/distinct_1": distinct_n(responses, 1),
      "eval/distinct_2": distinct_n(responses, 2),
      "eval/repetition_rate": repetition_rate(responses, 2),
  })
  return metrics, samples


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldOutEval:
  """Held-out prompts evaluated during training (`PPOTrainer(evaluation=...)`; from a run
  config: `RunConfig.eval_path`, `eval_every`, `eval_n`, `eval_temperature`, `eval_seed`)."""

  prompts: Sequence[Sequence[int]]
  """The token-id prompts (at least one), evaluated in this order."""
  every: int = 0
  """Evaluate after every this many updates; always after the last update
  (`PPOConfig.total_updates`); 0: only after the last."""
  n: int = 1
  """Samples per prompt (best-of-n); more than 1 needs a `temperature`."""
  temperature: float | None = None
  """None samples greedily; else the sampling temperature."""
  seed: int = 0
  """Seed of the evaluation's own sampling key."""

  def __post_init__(self):
    if len(self.prompts) == 0:
      raise ValueError("HeldOutEval.prompts is empty: give at least one held-out prompt.")
    check_eval_settings(every=self.every, seed=self.seed, n=self.n,
                        temperature=self.temperature, prefix="HeldOutEval.")

  def due(self, step: int, last_step: int) -> bool:
    """Whether the update that made the step count `step` is evaluated."""
    return step == last_step or (self.every > 0 and step % self.every == 0)


class HeldOutEvalHook:
  """The run loop's hook (`LoopHook`) that evaluates `evaluation` at its steps (see the module
  docstring); it never reports a collapse and has no state to checkpoint.

  Args:
    trainer: the `PPOTrainer` whose policy is evaluated.
    evaluation: the prompts and the schedule.
    last_step: the run's last step (`PPOConfig.total_updates`), always evaluated.
  """

  name = "held_out_eval"
  """The key of its (empty) state in a checkpoint's extra (`LoopHook.name`)."""

  def __init__(self, trainer: Evaluated, evaluation: HeldOutEval, *, last_step: int):
    if not isinstance(evaluation, HeldOutEval):
      raise ValueError(f"PPOTrainer(evaluation=...) takes a jax_ppo.ppo.evaluation.HeldOutEval, "
                       f"got {type(evaluation).__name__}.")
    self.trainer = trainer
    self.evaluation = evaluation
    self.last_step = last_step

  def after_step(self, step: int, metrics: dict[str, float]) -> None:
    """At a due step: the held-out metrics (`evaluate_prompts`) and `time/eval_s` added to
    `metrics`."""
    e = self.evaluation
    if not e.due(step, self.last_step):
      return
    start = time.perf_counter()
    held_out, _ = evaluate_prompts(self.trainer, e.prompts, n=e.n, temperature=e.temperature,
                                   seed=e.seed)
    metrics.update(held_out)
    metrics["time/eval_s"] = time.perf_counter() - start
    logger.info("Step %d: held-out reward %.4g, KL %.4g (%d prompts x %d).", step,
                held_out["eval/score_mean"], held_out["eval/kl"], len(e.prompts), e.n)

  def collapse(self) -> None:
    return None

  def clear_collapse(self) -> None:
    pass

  def rolled_back(self, step: int) -> None:
    del step

  def state_dict(self) -> dict[str, Any]:
    return {}

  def load_state_dict(self, state: Any) -> None:
    del state


__all__ = [
    "Evaluated",
    "HeldOutEval",
    "HeldOutEvalHook",
    "check_eval_sampling",
    "check_eval_settings",
    "evaluate_prompts",
]
