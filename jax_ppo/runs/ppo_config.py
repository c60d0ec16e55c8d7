"""`RunConfig`: what `jax-ppo train` computes, read from a YAML/JSON file and `key=value` overrides.

`load_run_config` builds it (preset values, then the file, then the overrides); `saved_run_config`
reads the one a run folder was trained with. `OPERATIONAL_FIELDS` lists the fields that may change
when a run is resumed.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from jax_ppo.compile_cache import AUTO as AUTO_CACHE
from jax_ppo.compile_cache import check_cache_setting
from jax_ppo.config_io import (
  CONFIG_FILENAME,
  apply_overrides,
  check_keys,
  config_from_dict,
  migrate_keys,
  read_config_file,
)
from jax_ppo.models import DEFAULT_REMAT, REMAT_POLICIES, LoRAConfig
from jax_ppo.parallel.distributed import DistributedConfig
from jax_ppo.parallel.mesh import MeshConfig
from jax_ppo.parallel.placement import PlacementConfig
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.ppo.monitor import MonitorConfig
from jax_ppo.ppo.presets import PRESETS, preset_overrides
from jax_ppo.rewards.specs import (
  MODULE_REWARD,
  REWARD_FUNCTIONS,
  RewardSource,
  parse_reward_function,
  reward_source_names,
)
from jax_ppo.runs.common import DTYPES
from jax_ppo.training.loop import RunOptions

OPERATIONAL_FIELDS = (
    "run_dir", "updates_per_run", "save_every", "keep_last", "best_metric", "best_mode",
    "log_samples_every", "tensorboard", "wandb", "wandb_init", "plots", "progress", "rollback",
    "rollback_lr_factor", "max_rollbacks", "monitor", "remat", "mesh", "placement", "distributed",
    "compilation_cache_dir",
)
"""`RunConfig` fields that may change between invocations of one run (they do not change what
is computed); a difference in any other field refuses to resume."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """Everything `run_training` needs; saved as `run_dir/config.yaml`."""

  policy_path: str
  """Hugging Face causal-LM folder of the SFT policy (config.json, safetensors, tokenizer)."""
  prompts_path: str
  """Training prompts: a .txt file (one prompt per line), or a .jsonl or .parquet file or a local
  Hugging Face datasets folder whose records hold a "prompt" string or chat "messages" (rendered
  with the tokenizer's chat template)."""
  run_dir: str
  """Run folder: config.yaml, metrics.jsonl, samples.jsonl, tensorboard/, checkpoints/."""
  ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
  """PPO hyperparameters. `ppo.sampling.pad_token_id` is taken from the tokenizer; empty
  `ppo.sampling.stop_token_ids` default to the tokenizer's and the model's EOS ids."""
  reward_model_path: str | None = None
  """Hugging Face `*ForSequenceClassification` folder (one label) of the reward model."""
  reward_function: str | None = None
  """A programmatic reward instead of a reward model: a built-in (`REWARD_FUNCTIONS`) or
  "package.module:function", a Python `fn(prompts, responses) -> scores` on texts
  (`MODULE_REWARD`)."""
  rewards: tuple[RewardSource, ...] = ()
  """Several reward sources combined with weights instead of one of the two fields above, e.g.
  `[{model_path: runs/rm, weight: 1.0}, {function: "my_rewards:brevity", weight: 0.1}]`; each
  source's raw score is checked and logged as `reward/<name>` (see `CombinedScorer`)."""
  value_model_path: str | None = None
  """Folder of the critic's initial weights (for advantage_mode "gae"); default: a copy of the
  reward model, or a zero-initialised value head on the policy with a reward function."""
  lora: LoRAConfig | None = None
  """Train LoRA adapters instead of every weight (e.g. `lora.rank=16`)."""
  preset: str | None = None
  """Scenario preset (`jax_ppo.ppo.presets.PRESETS`) applied to `ppo` before the file's and
  the command line's values."""
  pad_token: str | None = None
  """Pad token of the policy's tokenizer (e.g. "<unk>"); None: the tokenizer's own, else an
  existing unused special token (see `jax_ppo.models.load_tokenizer`). It must not be a stop
  token; a token missing from the vocabulary needs `resize_embeddings`."""
  resize_embeddings: bool = False
  """When the tokenizer has no usable pad token (GPT-2) or `pad_token` is new, add it and grow
  the embedding (and an untied LM head) of the policy and of the reward and value models that
  read its ids, new rows initialised to the mean row (`jax_ppo.models.resize_token_embeddings`).
  False: such a tokenizer is an error naming this switch."""
  dtype: str = "float32"
  """Compute dtype of every model: "float32", "bfloat16" or "float16". The weights, gradients and
  optimizer state stay float32 (master weights), and log-probs, entropies, norms and softmaxes
  are computed in float32 whatever this is."""
  remat: str = DEFAULT_REMAT
  """Rematerialisation of each transformer layer of the policy and critic in the training
  backward pass (less memory, more compute): "dots" (the default: keep the weight matmuls'
  outputs, recompute the rest; half the temporary memory of "none" at GPT-2-small size, same
  speed), "none" (keep every intermediate), "full" (recompute the whole layer; "layer" is the
  same), "dots_all" (keep every matmul output)
  or any argument-free `jax.checkpoint_policies` name, e.g. "dots_saveable"
  (`jax_ppo.models.REMAT_POLICIES`). Gradients are the same."""
  updates_per_run: int | None = None
  """Stop after this many updates in one invocation (None: run to `ppo.total_updates`); run the
  same command again to continue (for schedulers with time limits)."""
  save_every: int = 10
  """Checkpoint every this many updates (and at the end of each invocation)."""
  keep_last: int = 3
  """Number of most recent checkpoints kept."""
  best_metric: str | None = None
  """Also keep the checkpoint with the best value of this metric."""
  best_mode: str = "max"
  """"max" or "min" for `best_metric`."""
  log_samples_every: int = 10
  """Write samples to samples.jsonl every this many updates (0: never)."""
  tensorboard: bool = True
  """Write TensorBoard events."""
  wandb: bool = False
  """Also log metrics to Weights & Biases (needs the `wandb` package; without it a warning)."""
  wandb_init: dict[str, Any] | None = None
  """Keyword arguments of `wandb.init`, e.g. `{project: rlhf, name: run1}`; the run's
  configuration is passed as `config`, the run folder as `dir`."""
  plots: bool = True
  """Write PNG plots (reward, KL, entropy, response length) into `run_dir/plots` at the end of
  each invocation (also `jax-ppo plot RUN_DIR`)."""
  progress: bool = True
  """Show a progress bar."""
  rollback: bool = False
  """Roll back to the last good checkpoint when the monitor reports a collapse."""
  rollback_lr_factor: float = 0.5
  """Learning-rate multiplier applied at each rollback."""
  max_rollbacks: int = 3
  """Stop the run when it collapses again after this many rollbacks."""
  monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
  """Thresholds of the stability monitor, PPO's hook on the run loop (`PPOTrainer(monitor=...)`);
  its collapses trigger `rollback`."""
  mesh: MeshConfig | None = None
  """Device mesh `(data, fsdp, tensor)` (`jax_ppo.parallel.MeshConfig`; -1: the rest), e.g.
  `mesh.fsdp=8` to shard every model and the optimizer state over 8 devices; None: one device.
  A run may resume on another mesh (checkpoints restore into the new shardings)."""
  placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
  """Where the roles live (`jax_ppo.parallel.placement`): by default the reference, the reward
  model and the critic share the policy's mesh. `placement.reference`, `placement.reward` and
  `placement.critic` may each be `{devices: [start, stop), mesh: {...}}`, a slice of
  `jax.devices()` the policy does not use with its own mesh sizes (the same slice: they share
  it); their forward passes (and the critic's update) then run as their own programs there,
  rollout tokens going to them and log-probs / scores / values coming back by explicit
  transfers. `placement.policy_devices`: the policy's slice (default: every device no split
  role uses). Needs `mesh`; a LoRA policy keeps its reference shared (its base weights, one
  copy); a split critic must be a model of its own (not a value head on the policy) and its
  gradient is clipped by its own global norm (`jax_ppo.ppo.placed_critic`)."""
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  """Multi-host set-up (`jax_ppo.parallel.distributed`): "auto" joins a multi-process job when
  the environment or `distributed.coordinator_address` describes one (e.g.
  `distributed.coordinator_address=10.0.0.2:12355 distributed.num_processes=2
  distributed.process_id=1`); a single process otherwise."""
  compilation_cache_dir: str | None = AUTO_CACHE
  """Folder of JAX's persistent compilation cache, so that a second invocation (a resumed run,
  the next run of the same setup) loads its compiled programs instead of compiling them again:
  "auto" (`$JAX_PPO_CACHE_DIR`, else `~/.cache/jax_ppo/xla`; a folder JAX was already given is
  kept), a path, or null (or "off") to leave the cache to JAX's own settings
  (`jax_ppo.compile_cache`)."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"RunConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field in ("policy_path", "prompts_path", "run_dir"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give a path")
    given = [self.reward_model_path is not None, self.reward_function is not None,
             bool(self.rewards)]
    if sum(given) != 1:
      raise ValueError(
          "RunConfig needs exactly one reward source: reward_model_path (a Hugging Face "
          "SequenceClassification folder), reward_function (one of "
          f"{', '.join(REWARD_FUNCTIONS)}, or {MODULE_REWARD}), or rewards (a list of "
          "{function or model_path, weight} sources); got "
          f"reward_model_path={self.reward_model_path!r}, reward_function={self.reward_function!r}"
          f", rewards={list(self.rewards)!r}."
      )
    if not all(isinstance(r, RewardSource) for r in self.rewards):
      bad("rewards", "give a list of {function or model_path, weight, name} mappings")
    reward_source_names(self.rewards)
    if self.reward_function is not None:
      parse_reward_function(self.reward_function)
    if self.preset is not None and self.preset not in PRESETS:
      bad("preset", f"choose one of {sorted(PRESETS)} or null")
    if self.dtype not in DTYPES:
      bad("dtype", f"choose one of {list(DTYPES)}")
    if self.remat not in REMAT_POLICIES:
      bad("remat", f"choose one of {list(REMAT_POLICIES)}")
    if self.pad_token is not None and (not isinstance(self.pad_token, str) or not self.pad_token):
      bad("pad_token", "give a token string of the policy's vocabulary, or null")
    if not isinstance(self.resize_embeddings, bool):
      bad("resize_embeddings", "use true or false")
    check_cache_setting(self.compilation_cache_dir, field="RunConfig.compilation_cache_dir")
    self._check_placement()
    if self.updates_per_run is not None and (
        not isinstance(self.updates_per_run, int) or self.updates_per_run < 1):
      bad("updates_per_run", "use an int >= 1 or null")
    try:
      self.run_options()
    except ValueError as e:
      raise ValueError(str(e).replace("RunOptions.", "RunConfig.")) from None

  def _check_placement(self) -> None:
    p = self.placement
    if not isinstance(p, PlacementConfig):
      raise ValueError(f"RunConfig.placement={p!r} is invalid: give a mapping of "
                       "policy_devices, reference and reward (jax_ppo.parallel.PlacementConfig).")
    for role in p.split_roles:
      if self.mesh is None:
        raise ValueError(f"RunConfig.placement.{role} gives the {role} its own devices, but "
                         "RunConfig.mesh is null (one device); set mesh (e.g. mesh.data=-1 for "
                         f"the policy's devices) or set placement.{role} to null.")
    if p.reference is not None and self.lora is not None:
      raise ValueError("RunConfig.placement.reference must be null with lora: a LoRA policy's "
                       "reference is its own base weights with the adapters off (one copy on "
                       "the policy's mesh); remove placement.reference.")
    if p.reward is not None and not (self.reward_model_path is not None
                                     or any(r.model_path is not None for r in self.rewards)):
      raise ValueError("RunConfig.placement.reward gives the reward model its own devices, but "
                       "the run has no reward model (reward_function / function rewards have no "
                       "weights to place); remove placement.reward.")
    if p.critic is not None:
      has_reward_model = self.reward_model_path is not None or any(
          r.model_path is not None for r in self.rewards)
      why = None
      if not self.ppo.uses_critic:
        why = f"ppo.advantage_mode={self.ppo.advantage_mode!r} has no critic"
      elif self.value_model_path is None and not has_reward_model:
        why = ("without value_model_path or a reward model to start it from, the critic is a "
               "value head on the policy trunk")
      if why is not None:
        raise ValueError(
            f"RunConfig.placement.critic gives the critic its own devices, but the run has no "
            f"separate critic model ({why}); use advantage_mode 'gae' with value_model_path (or "
            "a reward model), or remove placement.critic.")

  def run_options(self) -> RunOptions:
    """The trainer's `RunOptions` for this run."""
    return RunOptions(
        save_every=self.save_every, keep_last=self.keep_last, best_metric=self.best_metric,
        best_mode=self.best_mode, log_samples_every=self.log_samples_every,
        tensorboard=self.tensorboard, wandb=self.wandb, wandb_init=self.wandb_init,
        plots=self.plots, progress=self.progress, rollback=self.rollback,
        rollback_lr_factor=self.rollback_lr_factor, max_rollbacks=self.max_rollbacks,
        resume_ignore=OPERATIONAL_FIELDS,
    )


def load_run_config(argv: Sequence[str]) -> RunConfig:
  """A `RunConfig` from at most one YAML/JSON file and `key=value` overrides.

  Precedence, lowest first: `PPOConfig` defaults, the `preset`'s values, the file, the overrides
  (e.g. `["configs/run.yaml", "ppo.optimizer.learning_rate=1e-6", "preset=dialogue"]`); the
  preset's values are merged key by key (a file's `ppo.optimizer.adam_eps` keeps a preset's
  `optimizer.learning_rate`).

  Raises:
    ValueError: unknown keys, bad values or an unknown preset (naming the key).
    FileNotFoundError: the config file does not exist.
  """
  files = [a for a in argv if "=" not in a]
  overrides = [a for a in argv if "=" in a]
  if len(files) > 1:
    raise ValueError(f"Give at most one config file, got {files}; other arguments are key=value.")
  data = read_config_file(files[0]) if files else {}
  if files:
    check_keys(RunConfig, data, source=f"Config file {files[0]!r}")
  return _with_preset(apply_overrides(RunConfig, data, overrides))


def merge_nested(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
  """`base` updated by `over`, key by key into nested mappings: `merge_nested({"optimizer":
  {"learning_rate": 1e-6}}, {"optimizer": {"adam_eps": 1e-8}})` keeps both values."""
  out = dict(base)
  for key, value in over.items():
    if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
      out[key] = merge_nested(out[key], value)
    else:
      out[key] = value
  return out


def _with_preset(data: dict[str, Any]) -> RunConfig:
  """The `RunConfig` of `data` with its `preset`'s values under the `ppo` section's."""
  preset = data.get("preset")
  if preset is not None:
    if preset not in PRESETS:
      raise ValueError(f"RunConfig.preset={preset!r} is invalid: choose one of "
                       f"{sorted(PRESETS)} or null.")
    ppo = data.get("ppo") or {}
    if not isinstance(ppo, Mapping):
      raise ValueError(f"Config key 'ppo' must be a mapping of PPOConfig fields, got {ppo!r}.")
    data = {**data, "ppo": merge_nested(preset_overrides(preset), ppo)}
  return config_from_dict(RunConfig, data)


def saved_run_config(run_dir: str | os.PathLike) -> RunConfig:
  """The `RunConfig` a run folder was trained with (its `config.yaml`).

  A folder written before a key moved (`PPOConfig.MOVED_KEYS`: e.g. `ppo.learning_rate`, now
  `ppo.optimizer.learning_rate`) reads with the same meaning (`jax_ppo.config_io.migrate_keys`).
  """
  if not pathlib.Path(run_dir).is_dir():
    raise FileNotFoundError(
        f"Run folder {str(run_dir)!r} does not exist; pass the run_dir of a `jax-ppo train` run."
    )
  path = pathlib.Path(run_dir) / CONFIG_FILENAME
  if not path.is_file():
    raise FileNotFoundError(
        f"{str(run_dir)!r} has no {CONFIG_FILENAME}; pass the run folder written by "
        "`jax-ppo train` (RunConfig.run_dir)."
    )
  data = migrate_keys(RunConfig, read_config_file(path))
  check_keys(RunConfig, data, source=f"Config file {str(path)!r}")
  return _with_preset(data)
