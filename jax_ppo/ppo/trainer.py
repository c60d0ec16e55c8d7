"""The RLHF loop: rollout -> scoring -> experience -> PPO epochs, one update at a time.

`PPOTrainer` owns the host-side orchestration only: prompt batches, the sampler, the reward
source, timing and metrics. All math runs in the compiled `PPOSteps` functions over the
immutable `TrainState`. One trainer serves every advantage mode ("gae" with a critic, "grpo",
"rloo", "reinforce++").

With a `run_dir`, `train()` also runs the run's bookkeeping after every update (`RunOptions`):

* `MetricsLogger`: `metrics.jsonl`, `samples.jsonl` (every `log_samples_every` updates),
  TensorBoard, and a tqdm progress bar;
* `StabilityMonitor` (`jax_ppo.ppo.monitor`, the trainer's hook on the run loop): warnings are
  logged (`jax_ppo.monitor`) and counted in `monitor/warnings`;
* `HeldOutEvalHook` (`jax_ppo.ppo.evaluation`, with `evaluation`): held-out prompts sampled and
  scored every `evaluation.every` updates and after the last, logged under `eval/`;
* `RunCheckpointer` (`run_dir/checkpoints`): the `TrainState` plus the data position, the
  monitor's state and the host step, every `save_every` updates and at the end of `train()`;
* `run_dir/config.yaml`: the run's configuration (`run_config`, default the `PPOConfig`).

Steps are counted in updates done: the metrics of the first update, and the checkpoint taken
after it, have step 1.

Resuming: constructing a trainer on a `run_dir` that holds checkpoints restores the latest
`TrainState`, data position and monitor state, and truncates the logs after that step, so running
the same program again continues the run. The rollout key of update `n` is
`fold_in(PRNGKey(seed + 1), n)` and the prompt order depends only on the data position, so a
resumed run reproduces the uninterrupted one exactly (with `PPOConfig.dynamic_sampling`, draw `d`
of an update reads batch `data_position + d` with `dynamic_sampling.draw_key(key, d)`, and the
data position advances by the draws taken). The replay buffer
(`PPOConfig.replay_buffer_size`: its batches, which may have different prompt lengths, through
`RunCheckpointer`'s `arrays`) and the state of its random generator are saved with every
checkpoint, so runs that replay resume exactly too.

Preemption: SIGTERM or SIGINT during `train()` (main thread, run folder) lets the update in
flight finish (or abandons it after the rollout, before it changes anything), saves a
checkpoint and returns; `preempted` names the signal. See `jax_ppo.training.loop`.

Non-finite updates: an optimizer step whose loss or gradient is NaN or infinite is skipped in
the compiled step (state unchanged) and counted in `skipped_updates` (replayed batches
included); after `PPOConfig.max_consecutive_skips` consecutive updates with skips, `train()`
raises `NonFiniteUpdates` naming likely causes and the last checkpoint before the skips.

Several processes (a multi-host job, `jax_ppo.parallel.distributed`; a mesh is required): each
process reads, pads and places only its own rows of every prompt batch, host-side rewards score
only those rows (`jax_ppo.parallel.host_rows`), process 0 alone writes logs, samples and exports.

Rollback (`RunOptions.rollback`): when the monitor reports a collapse at update `n`, the latest
checkpoint before `n` is restored, `lr_scale` is multiplied by `rollback_lr_factor`, the monitor
forgets the updates after the restored step, and training continues from there (at most
`max_rollbacks` times).
"""

from __future__ import annotations

import collections
import logging
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

from jax_ppo.checkpoint import CheckpointError, RunCheckpointer
from jax_ppo.data.prompts import PromptDataset
from jax_ppo.logging import MetricsLogger
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.lora import has_lora
from jax_ppo.models.transformer import layer_loop
from jax_ppo.parallel import host_rows
from jax_ppo.parallel.distributed import multi_process, require_mesh
from jax_ppo.parallel.placement import Placement
from jax_ppo.ppo import dynamic_sampling, perf, prompt_shards
from jax_ppo.ppo.batch import Batch, process_scores
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.ppo.evaluation import HeldOutEval, HeldOutEvalHook
from jax_ppo.ppo.monitor import MonitorConfig, StabilityMonitor
from jax_ppo.ppo.placed_steps import (
  critic_split,
  eval_logprobs_program,
  place_frozen,
  place_state,
  placed_steps,
  resolve_placement,
  score,
)
from jax_ppo.ppo.state import FrozenParams, TrainState, check_reference, init_train_state
from jax_ppo.ppo.steps import PPOSteps
from jax_ppo.rewards.scorers import CombinedScorer, as_scorer, decode_rollout
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Rollout, Sampler
from jax_ppo.training.export import export_pretrained
from jax_ppo.training.loop import (
  CHECKPOINT_DIR,
  RunLoop,
  RunOptions,
  StepAbandoned,
  TrainingHistory,
)
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.stage import RunStage

__all__ = ["PPOTrainer"]


def _rng_state(state: dict[str, Any], *, encode: bool) -> dict[str, Any]:
  """A numpy `PCG64` bit-generator state with its 128-bit integers as decimal strings (JSON
  stores them exactly) (`encode`), or back."""
  if state.get("bit_generator") != "PCG64":
    raise ValueError(f"Expected a PCG64 generator state, got {state.get('bit_generator')!r}.")
  convert = str if encode else int
  return {**state, "state": {k: convert(v) for k, v in state["state"].items()}}


def _to_host(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


logger = logging.getLogger(__name__)


class PPOTrainer(RunStage):
  """PPO / GRPO / RLOO / REINFORCE++ for a causal LM.

  Args:
    config: the run's `PPOConfig`.
    policy: a `jax_ppo.models.CausalLM` (with LoRA adapters from `add_lora` for LoRA training).
    reward: a `ScalarModel` reward model, a scorer from `jax_ppo.rewards.scorers`, or a Python
      function `fn(prompts, responses) -> scores` (texts when `tokenizer` is given, else ids).
    prompts: a `PromptDataset` of token-id prompts.
    tokenizer: the policy's tokenizer (for text rewards and sample logging).
    value_model: a separate critic (`ScalarModel`, e.g. `value_model_from_reward_model(rm)`);
      without one, "gae" puts a zero-initialised value head on the policy trunk.
    reference: the reference policy (a `CausalLM` of the policy's architecture and vocabulary,
      e.g. loaded from `RunConfig.reference_path`); its parameters are the frozen reference of
      the KL. None: the policy's starting weights. Not with LoRA (the reference is then the base
      weights).
    reference_field: how errors name `reference` (e.g. "RunConfig.reference_path").
    memory_budget_bytes: rollout micro-batching budget (see `Sampler`).
    peak_flops: the whole job's matmul peak (FLOP/s) for the `mfu` metric; None: the
      datasheet per-chip peak for the policy's compute dtype times the job's chips, or a
      measured rate on a CPU (`perf.job_peak_flops`), taken when training starts.
    run_dir: run folder for logs, checkpoints and `config.yaml`; when it holds checkpoints the
      latest is restored (see the module docstring). None: no bookkeeping.
    run_options: logging, checkpointing and rollback settings (`RunOptions`).
    monitor: thresholds of the stability monitor (`MonitorConfig`; None: the defaults), the
      trainer's hook on the run loop: its collapses trigger `run_options.rollback`.
    evaluation: held-out prompts evaluated during training with a run folder (`HeldOutEval`:
      every `evaluation.every` updates and after the last; `jax_ppo.ppo.evaluation`), their
      `eval/...` metrics logged with the update's. None: no evaluation during training.
    run_config: the dataclass written to `run_dir/config.yaml` and stored with every checkpoint
      (default: `config`); resuming under a different one raises `CheckpointConfigMismatch`
      naming the differing fields (except `run_options.resume_ignore`).
    mesh: a device mesh (`jax_ppo.parallel.make_mesh`): the policy, its reference, the critic,
      the reward model and the optimizer state are placed on it by the logical-axis rules
      (`jax_ppo.parallel.shard_params`; one mesh shared by every role, a LoRA policy's reference
      being its own base weights), and the steps and the sampler are compiled with explicit
      shardings. Checkpoints restore into these shardings whatever mesh wrote them. None: one
      device, as without the argument.
    placement: where each role lives (`jax_ppo.parallel.placement.make_placement`): the
      reference, the reward model and a separate critic may get sub-meshes of their own
      (`jax_ppo.ppo.placed_steps`, `jax_ppo.ppo.placed_critic`); its `policy` mesh is the trainer's
      mesh. None: every role on `mesh`.

  Call `close()` (or use the trainer as a context manager) to flush the logs and wait for the
  last checkpoint.
  """

  def __init__(
      self,
      config: PPOConfig,
      policy: nnx.Module,
      *,
      reward,
      prompts: PromptDataset,
      tokenizer=None,
      value_model: ScalarModel | None = None,
      reference: nnx.Module | None = None,
      reference_field: str = "PPOTrainer(reference=...)",
      memory_budget_bytes: int | None = None,
      peak_flops: float | None = None,
      run_dir: str | os.PathLike | None = None,
      run_options: RunOptions | None = None,
      monitor: MonitorConfig | None = None,
      evaluation: HeldOutEval | None = None,
      run_config: Any = None,
      mesh: Mesh | None = None,
      placement: Placement | None = None,
  ):
    self.config = c = config
    if c.dynamic_sampling and multi_process():
      raise ValueError(
          f"PPOConfig.dynamic_sampling=True is not supported with several processes (this is "
          f"process {jax.process_index()} of {jax.process_count()}): the kept prompt groups "
          "would have to move between the processes' rows; set dynamic_sampling=False or train "
          "in one process.")
    self.placement = resolve_placement(mesh, placement)
    mesh = None if self.placement is None else self.placement.policy
    require_mesh(mesh, config_field="RunConfig.mesh", trainer="PPOTrainer")
    self.mesh = mesh
    self.dataset = prompts
    self.tokenizer = tokenizer
    self.scorer = as_scorer(reward, tokenizer)
    self.lora = has_lora(policy)

    shared_value_head = c.uses_critic and value_model is None
    if shared_value_head and policy.value_head is None:
      policy.add_value_head()
    if self.lora:
      trainable = nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))
    else:
      trainable = nnx.Param
    with layer_loop(policy, c.train_scan_layers):
      self.policy_graphdef, policy_params, policy_rest = nnx.split(policy, trainable, ...)
    value_graphdef = value_params = value_rest = None
    if c.uses_critic and value_model is not None:
      with layer_loop(value_model, c.train_scan_layers):
        value_graphdef, value_params, value_rest = nnx.split(value_model, nnx.Param, ...)
    if reference is not None:
      if self.lora:
        raise ValueError(f"{reference_field}: a LoRA policy's reference is its own base weights "
                         "(adapters off); give no separate reference, or train without LoRA.")
      if policy.value_head is not None and getattr(reference, "value_head", None) is None:
        reference.add_value_head()  # (the policy's graph has one; the reference never reads it)
      with layer_loop(reference, c.train_scan_layers):
        ref = nnx.split(reference, nnx.Param, ...)[1]
      check_reference(policy_params, ref, field=reference_field)
    else:
      ref = None if self.lora else jax.tree.map(jnp.copy, policy_params)
    self.frozen = FrozenParams(
        policy_rest=policy_rest,
        ref=ref,
        value_rest=value_rest,
        reward=getattr(self.scorer, "state", None),
    )
    if mesh is not None:
      self.frozen = place_frozen(self.frozen, self.placement, self.scorer)
    self.optimizer, self.schedule = make_optimizer(c.optimizer, c.total_optimizer_steps)
    ppo_steps = PPOSteps(
        c,
        policy_graphdef=self.policy_graphdef,
        value_graphdef=value_graphdef,
        shared_value_head=shared_value_head,
        lora=self.lora,
        optimizer=self.optimizer,
        schedule=self.schedule,
        mesh=mesh,
        critic_apart=critic_split(self.placement),
    )
    self.steps = placed_steps(ppo_steps, self.placement)
    state = init_train_state(
        c, self.optimizer, policy=policy_params, value=value_params,
        rng=jax.random.PRNGKey(c.seed),
    )
    # Committed to its devices, as a restored checkpoint is, so that resuming or rolling back
    # hands the jitted steps the same argument signature (no recompilation).
    if mesh is None:
      self.state: TrainState = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
    else:
      self.state = place_state(state, self.placement)
    self.sampling = SamplingConfig.from_params(c.sampling, n_samples=c.n_samples,
                                               batch_buckets=(c.prompts_per_update,))
    with layer_loop(policy, c.rollout_scan_layers):
      self.sampler = Sampler(policy, self.sampling, memory_budget_bytes=memory_budget_bytes,
                             mesh=mesh)
    self._rollout_key = jax.random.PRNGKey(c.seed + 1)
    self.replay: collections.deque[Batch] = collections.deque(maxlen=c.replay_buffer_size or 1)
    self._replay_rng = np.random.default_rng(c.seed + 2)
    self.data_position = 0
    self.peak_flops = peak_flops
    self.compute_dtype = policy.dtype
    self._param_counts = (
        perf.count_params(policy_params) + perf.count_params(policy_rest),
        perf.count_params(value_params) if value_params is not None else 0,
        perf.count_params(self.frozen.reward) if self.frozen.reward is not None else 0,
    )
    # `eval_logprobs(trainable, frozen, rollout) -> (logprobs, ref_logprobs)` `[B, T]`, 0 on
    # padding: evaluation's program over the one log-prob path of training
    # (`jax_ppo.ppo.forward`), split over the roles' meshes with a placement.
    self.eval_logprobs = eval_logprobs_program(ppo_steps.forward.eval_logprobs, self.steps,
                                                self.placement,
                                                temperature=c.sampling.temperature)
    self._eval_samplers: dict[tuple, Sampler] = {}
    self.last_rollout: Rollout | None = None
    self.last_scores: np.ndarray | None = None
    self.last_prompt_texts: list[str] | None = None

    self.run_options = run_options if run_options is not None else RunOptions()
    if monitor is not None and not isinstance(monitor, MonitorConfig):
      raise ValueError(f"PPOTrainer(monitor=...) takes a jax_ppo.ppo.monitor.MonitorConfig, got "
                       f"{type(monitor).__name__}.")
    self.stability_monitor = StabilityMonitor(monitor)
    hooks = (self.stability_monitor,)  # (the monitor never sees the held-out metrics)
    if evaluation is not None:
      hooks += (HeldOutEvalHook(self, evaluation, last_step=c.total_updates),)
    self.run_config = run_config if run_config is not None else config
    self.preempted: str | None = None
    self.run = RunLoop(
        self, None if run_dir is None else pathlib.Path(run_dir), options=self.run_options,
        run_config=self.run_config, total_steps=c.total_updates,
        max_consecutive_skips=c.max_consecutive_skips, hooks=hooks,
    )

  # -- run folder: resume, logging, checkpoints (`RunLoop`) -----------------------------------

  @property
  def checkpointer(self) -> RunCheckpointer | None:
    return self.run.checkpointer

  @property
  def logger(self) -> MetricsLogger | None:
    return self.run.logger

  @property
  def monitor(self) -> StabilityMonitor:
    """The stability monitor (the run loop's hook; it sees updates only with a run folder)."""
    return self.stability_monitor

  @property
  def rollbacks(self) -> int:
    return self.run.rollbacks

  @property
  def _bar(self):
    return self.run.bar

  def restore_checkpoint(self, checkpointer: RunCheckpointer, step: int | None) -> dict:
    """Restores state and data position from a checkpoint (None: the latest); returns its
    extra (`Stage` of `RunLoop`)."""
    state, extra = checkpointer.restore(step, like=self.state)
    if "data_position" not in extra:
      raise CheckpointError(
          f"The checkpoint in {str(checkpointer.directory)!r} has no data position: it was not "
          "written by a PPOTrainer; restore it with RunCheckpointer.restore instead."
      )
    replay = []
    if extra.get("replay"):  # [{field: [shape, dtype]}] per buffered batch, oldest first
      sharding = state.step.sharding
      like = [
          Batch(**{k: jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
                   for k, (shape, dtype) in layout.items()})
          for layout in extra["replay"]
      ]
      replay = checkpointer.restore_arrays(int(extra["step"]), like={"replay": like})["replay"]
    elif self.config.replay_buffer_size and "replay" not in extra:
      logger.warning("The checkpoint of step %s predates replay-buffer checkpoints: the buffer "
                     "restarts empty, so this run resumes close to, not exactly like, an "
                     "uninterrupted one.", extra.get("step"))
    self.state = state
    self.data_position = int(extra["data_position"])
    self.replay.clear()
    self.replay.extend(replay)
    if extra.get("replay_rng") is not None:
      self._replay_rng.bit_generator.state = _rng_state(extra["replay_rng"], encode=False)
    self.last_rollout = self.last_scores = self.last_prompt_texts = None
    return extra

  def checkpoint_extra(self) -> dict[str, Any]:
    """What a checkpoint stores besides the `TrainState` (JSON), before `RunLoop`'s own."""
    return {
        "step": self.step_count,
        "data_position": self.data_position,
        "replay": [{k: [list(x.shape), str(x.dtype)] for k, x in vars(b).items()}
                   for b in self.replay],
        "replay_rng": _rng_state(self._replay_rng.bit_generator.state, encode=True),
    }

  def checkpoint_arrays(self) -> dict[str, Any]:
    """Pytrees of arrays saved beside the `TrainState`: the replay buffer's batches."""
    return {"replay": list(self.replay)} if self.replay else {}

  def load_checkpoint(self, path: str | os.PathLike, *, step: int | None = None) -> int:
    """Restores a saved `TrainState` and data position (read-only; e.g. to evaluate or export).

    Args:
      path: a run folder (with a `checkpoints/` sub-folder) or a checkpoint folder.
      step: the step to restore; None restores the latest.

    Returns:
      The restored step.

    Raises:
      CheckpointError: no checkpoint, no such step, or unreadable (e.g. another model setup).
    """
    path = pathlib.Path(path)
    if (path / CHECKPOINT_DIR).is_dir():
      path = path / CHECKPOINT_DIR
    checkpointer = RunCheckpointer(path, read_only=True)
    try:
      if checkpointer.latest_step() is None:
        raise CheckpointError(f"No checkpoint in {str(path)!r}; train first.")
      return self.run.restore(checkpointer, step)
    finally:
      checkpointer.close()

  # -- one update ----------------------------------------------------------------------------

  def policy_state(self, state: TrainState | None = None) -> tuple:
    """The sampler's view of the policy: `(trainable, frozen rest)`."""
    state = self.state if state is None else state
    return (state.policy, self.frozen.policy_rest)

  def step(self) -> dict[str, float]:
    """Runs one PPO update (rollout, scoring, experience, epochs) and returns its metrics."""
    c = self.config
    t_start = time.perf_counter()
    key = jax.random.fold_in(self._rollout_key, self.step_count)
    draws, varied, t_sampling = [], [], 0.0
    for d in range(c.dynamic_sampling_max_draws if c.dynamic_sampling else 1):
      t_draw = time.perf_counter()
      position, draw_key = self.data_position + d, dynamic_sampling.draw_key(key, d)
      if multi_process():  # each process reads, pads and places only its own rows
        rollout, texts = prompt_shards.sample_local_prompts(
            self.sampler, self.dataset, position, c.prompts_per_update, draw_key,
            state=self.policy_state())
      else:
        prompt_ids, texts = self.dataset.batch(position, c.prompts_per_update)
        rollout = self.sampler(prompt_ids, draw_key, state=self.policy_state())
      jax.block_until_ready(rollout.response_ids)
      t_sampling += time.perf_counter() - t_draw
      raw_scores = score(self.placement, self.scorer, rollout, self.frozen.reward)
      draws.append((rollout, raw_scores, texts))
      if c.dynamic_sampling:  # DAPO: draw until the batch holds enough groups that vary
        metric = raw_scores if c.dynamic_sampling_metric == "raw_score" else process_scores(
            c, raw_scores, rollout)
        varied.append(dynamic_sampling.varied_groups(np.asarray(metric), c.n_samples))
        if sum(int(v.sum()) for v in varied) >= c.prompts_per_update:
          break
    sampling_metrics = {}
    if c.dynamic_sampling:
      rollout, raw_scores, texts, sampling_metrics = self._assemble(draws, varied)
    jax.block_until_ready(raw_scores)
    t_rollout = t_start + t_sampling
    t_score = time.perf_counter()
    if self.run.stop_requested:  # preempted: nothing has changed yet, leave the rest undone
      raise StepAbandoned

    if self.steps.fuses_first_epoch:  # the first epoch's forward gives the old log-probs
      self.state, batch, exp_metrics, upd_metrics = self.steps.experience_update(
          self.state, self.frozen, rollout, raw_scores
      )
    else:
      batch, exp_metrics = self.steps.experience(self.state, self.frozen, rollout, raw_scores)
      self.state, upd_metrics = self.steps.update(
          self.state, self.frozen, batch, exp_metrics["objective/kl"]
      )
    if c.replay_buffer_size:
      if c.replay_batches_per_update and len(self.replay) > 0:
        picks = self._replay_rng.integers(0, len(self.replay), c.replay_batches_per_update)
        for j in picks:
          self.state, replay_metrics = self.steps.replay_update(
              self.state, self.frozen, self.replay[int(j)], jnp.zeros((), jnp.float32)
          )
          upd_metrics["skipped_updates"] += replay_metrics["skipped_updates"]
      self.replay.append(batch)
    metrics = _to_host({**exp_metrics, **upd_metrics})
    if isinstance(self.scorer, CombinedScorer):  # each source's raw score, `reward/<name>`
      metrics.update(self.scorer.metrics())
    metrics.update(sampling_metrics)
    t_end = time.perf_counter()
    self.data_position += len(draws)

    prompt_len = int(rollout.prompt_ids.shape[1])
    tokens = c.batch_size * (prompt_len + c.sampling.max_new_tokens)
    flops = perf.update_flops(
        policy_params=self._param_counts[0], critic_params=self._param_counts[1],
        reward_params=self._param_counts[2], batch=c.batch_size, prompt_len=prompt_len,
        response_len=c.sampling.max_new_tokens, epochs=c.ppo_epochs,
        fused_first_epoch=self.steps.fuses_first_epoch,
    )
    total = t_end - t_start
    metrics.update({
        "time/rollout_s": t_rollout - t_start,
        "time/score_s": t_score - t_rollout,
        "time/update_s": t_end - t_score,
        "time/total_s": total,
        "tokens_per_s": tokens / total,
        "eps": c.batch_size / total,
        "episode": float(self.state.episode),
        "step": float(self.step_count),
        "rollout/prompt_len": float(prompt_len),
        "rollout/response_length": float(
            host_rows.gathered(rollout.response_mask).sum(1).mean()),
    })
    if self.peak_flops:
      metrics["mfu"] = flops / total / self.peak_flops
    self.last_rollout = rollout
    # (several processes: the global scores, gathered for the logged samples only; the texts of
    # this process's prompts)
    self.last_scores = raw_scores if host_rows.is_global(raw_scores) else np.asarray(raw_scores)
    self.last_prompt_texts = texts
    return metrics

  def _assemble(self, draws: list, varied: list) -> tuple[Rollout, Any, list | None, dict]:
    """Dynamic sampling: the batch's rollout, raw scores and prompt texts from the draws'
    `(rollout, raw scores, texts)` and varied groups, placed as the first draw's (so the
    compiled programs see the signature they always do), and its metrics."""
    n = self.config.n_samples
    selection = dynamic_sampling.select_groups(varied, self.config.prompts_per_update)
    rollout = dynamic_sampling.assemble_rollout(
        [r for r, _, _ in draws], selection, n_samples=n,
        pad_token_id=self.config.sampling.pad_token_id)
    scores = dynamic_sampling.assemble_rows([np.asarray(s) for _, s, _ in draws], selection, n)
    first_rollout, first_scores, _ = draws[0]

    def place(x, like):
      return jax.device_put(x, like.sharding) if isinstance(like, jax.Array) else x

    return (jax.tree.map(place, rollout, first_rollout), place(scores, first_scores),
            dynamic_sampling.assemble_texts([t for _, _, t in draws], selection),
            dynamic_sampling.sampling_metrics(varied, selection))

  def train(
      self, num_updates: int | None = None, *, callback: Callable[[dict], Any] | None = None
  ) -> TrainingHistory:
    """Trains until `num_updates` more updates are done (default: up to `total_updates`).

    With a run folder every update is monitored, logged and checkpointed (see the module
    docstring) and the last step is saved before returning; `callback(metrics)` runs after
    that bookkeeping. SIGTERM or SIGINT (main thread, run folder) finishes the update in flight,
    saves a checkpoint and returns early; `preempted` (here and on the returned history) then
    names the signal. Returns the metrics of every update run (a rollback makes the step count
    go back, so the list can be longer than `num_updates`).
    """
    if self.peak_flops is None:
      self.peak_flops = perf.job_peak_flops(self.compute_dtype)
    total = self.config.total_updates
    target = total if num_updates is None else min(total, self.step_count + num_updates)
    history = self.run.train(target, callback=callback)
    self.preempted = history.preempted
    return history

  # -- samples and evaluation ----------------------------------------------------------------

  def samples(self, *, stage: str = "train", limit: int = 4) -> list[dict[str, Any]]:
    """`{stage, step, prompt, response, reward}` records of the last rollout."""
    if self.last_rollout is None:
      return []
    # (several processes: every process gathers the `limit` rows, as `RunLoop.record` calls
    # this on every process; only process 0's logger writes them)
    r = jax.tree.map(lambda x: host_rows.gathered(x[:limit]), self.last_rollout)
    prompts, responses = self._texts(r)
    scores = host_rows.gathered(self.last_scores[:limit])
    return [
        {"stage": stage, "step": self.step_count, "prompt": p, "response": q,
         "reward": float(s)}
        for p, q, s in zip(prompts, responses, scores, strict=True)
    ]

  def evaluate(
      self, prompts: list[list[int]], *, temperature: float | None = None, seed: int = 0
  ) -> dict[str, float]:
    """Samples held-out prompts greedily (or at `temperature`) and scores them (item 20).

    Returns `eval/score_mean`, `eval/score_std`, `eval/response_length`, `eval/kl` (sum over
    tokens of log pi - log pi_ref, mean over responses) and `eval/entropy` (mean negative
    log-prob per token).
    """
    return self.evaluate_with_samples(prompts, temperature=temperature, seed=seed)[0]

  def evaluate_with_samples(
      self,
      prompts: Sequence[Sequence[int]],
      *,
      temperature: float | None = None,
      seed: int = 0,
      chunk_size: int = 64,
  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """`evaluate`, also returning one `{prompt, response, reward, length, kl}` record per prompt.

    Prompts are sampled in chunks of `chunk_size` (the chunk's key is `fold_in(key(seed), i)`);
    samplers are cached per temperature, so repeated evaluations do not recompile.
    """
    if len(prompts) == 0:
      raise ValueError("evaluate: `prompts` is empty; pass at least one prompt.")
    greedy = temperature is None
    sampler = self._eval_samplers.get((greedy, temperature))
    if sampler is None:
      sampling = SamplingConfig(
          max_new_tokens=self.config.sampling.max_new_tokens,
          temperature=1.0 if greedy else temperature,
          greedy=greedy,
          stop_token_ids=self.config.sampling.stop_token_ids,
          pad_token_id=self.config.sampling.pad_token_id,
      )
      with layer_loop(self.policy_model(), self.config.rollout_scan_layers) as model:
        sampler = self._eval_samplers[(greedy, temperature)] = Sampler(model, sampling,
                                                                       mesh=self.mesh)
    key = jax.random.PRNGKey(seed)
    scores, lengths, kls, logprob_sums, samples = [], [], [], [], []
    for i, start in enumerate(range(0, len(prompts), chunk_size)):
      rollout = sampler(list(prompts[start:start + chunk_size]), jax.random.fold_in(key, i),
                        state=self.policy_state())
      chunk_scores = np.asarray(host_rows.gathered(score(self.placement, self.scorer, rollout,
                                                        self.frozen.reward)),
                                np.float64)
      logprobs, ref_logprobs = (host_rows.gathered(x) for x in self.eval_logprobs(
          self.state.policy, self.frozen, rollout))
      rollout = jax.tree.map(host_rows.gathered, rollout)  # (several processes: all rows)
      mask = np.asarray(rollout.response_mask).astype(bool)
      chunk_kl = np.sum((logprobs - ref_logprobs) * mask, axis=1)
      scores.append(chunk_scores)
      lengths.append(mask.sum(1))
      kls.append(chunk_kl)
      logprob_sums.append(np.sum(logprobs * mask, axis=1))
      texts = self._texts(rollout)
      samples.extend(
          {"prompt": p, "response": r, "reward": float(sc), "length": int(n), "kl": float(k)}
          for p, r, sc, n, k in zip(*texts, chunk_scores, mask.sum(1), chunk_kl, strict=True)
      )
    scores, lengths = np.concatenate(scores), np.concatenate(lengths)
    metrics = {
        "eval/score_mean": float(scores.mean()),
        "eval/score_std": float(scores.std()),
        "eval/response_length": float(lengths.mean()),
        "eval/kl": float(np.concatenate(kls).mean()),
        "eval/entropy": float(-np.concatenate(logprob_sums).sum() / max(lengths.sum(), 1)),
    }
    return metrics, samples

  def _texts(self, rollout: Rollout) -> tuple[list, list]:
    """Prompts and responses of a rollout: texts with a tokenizer, else valid token ids."""
    if self.tokenizer is not None:
      return decode_rollout(self.tokenizer, rollout)
    prompts = [np.asarray(p)[np.asarray(m) != 0].tolist()
               for p, m in zip(rollout.prompt_ids, rollout.prompt_mask, strict=True)]
    responses = [np.asarray(p)[np.asarray(m)].tolist()
                 for p, m in zip(rollout.response_ids, rollout.response_mask, strict=True)]
    return prompts, responses

  def policy_model(self) -> nnx.Module:
    """The current policy as an NNX module (for export with `save_pretrained`)."""
    return nnx.merge(self.policy_graphdef, *self.policy_state())

  def export(
      self, path: str | os.PathLike, *, dtype=None, max_shard_size: int | str | None = "5GB"
  ) -> pathlib.Path:
    """Writes the current policy as a Hugging Face causal-LM folder.

    LoRA adapters are merged into the kernels and a value head on the policy trunk is left out
    (`jax_ppo.models.save_pretrained`); the tokenizer, when the trainer has one, is saved next
    to it. `jax_ppo.models.from_pretrained` and `transformers.AutoModelForCausalLM` load it.
    Several processes: every process calls it; process 0 writes, gathering one tensor at a
    time, and every process returns once the folder is complete.

    Args:
      path: output folder (created).
      dtype: dtype of the written tensors (None keeps the parameter dtype).
      max_shard_size: bytes (or e.g. "2GB") per safetensors file.

    Returns:
      The folder written.
    """
    return export_pretrained(self.policy_model(), path, tokenizer=self.tokenizer, dtype=dtype,
                             max_shard_size=max_shard_size)
