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
from typing import Any, ClassVar

from jax_ppo.config_io import (
  CONFIG_FILENAME,
  apply_overrides,
  check_keys,
  config_from_dict,
  migrate_keys,
  read_config_file,
)
from jax_ppo.models import DEFAULT_REMAT, REMAT_POLICIES
from jax_ppo.parallel.placement import PlacementConfig
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.ppo.evaluation import check_eval_settings
from jax_ppo.ppo.monitor import MonitorConfig
from jax_ppo.ppo.presets import PRESETS, preset_overrides
from jax_ppo.rewards.specs import RewardSource
from jax_ppo.runs.common import PPO_RUN_FIELDS, BaseRunConfig, PPORunFolder
from jax_ppo.runs.paths import PathField, check_run_paths
from jax_ppo.runs.scoring import check_reward_source

EVAL_FIELDS = ("eval_path", "eval_every", "eval_n", "eval_temperature", "eval_seed")
"""`RunConfig` fields of the evaluation on held-out prompts during training."""

OPERATIONAL_FIELDS = ("run_dir", "export_adapter_dir", "run", "monitor", "remat", "mesh",
                      "placement", "distributed", "compilation_cache_dir", "value_model_new_head",
                      *EVAL_FIELDS)
"""`RunConfig` fields (dotted keys or prefixes: `run` is the whole run block) that may change
between invocations of one run (they do not change what is computed: `value_model_new_head` only
shapes the critic a run starts with, which a resumed run restores from its checkpoint; the
evaluation's fields only what is logged under `eval/`); a difference in any other field refuses
to resume."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(BaseRunConfig):
  """Everything `run_training` needs; saved as `run_dir/config.yaml`. The fields every run config
  has (`run_dir`, `lora`, `dtype`, `pad_token`, `resize_embeddings`, `mesh`, `distributed`,
  `compilation_cache_dir`) are `BaseRunConfig`'s; the run folder's options are the `run` block
  (`PPORunFolder`)."""

  policy_path: str
  """Hugging Face causal-LM folder of the SFT policy (config.json, safetensors, tokenizer), or a
  Hugging Face Hub id `org/name[@revision]` already in the local cache (`hf download org/name`;
  never downloaded by a run). Every model field takes either."""
  prompts_path: str
  """Training prompts: a .txt file (one prompt per line), or a .jsonl or .parquet file or a local
  Hugging Face datasets folder whose records hold a "prompt" string or chat "messages" (rendered
  with the tokenizer's chat template)."""
  eval_path: str | None = None
  """Held-out prompts (the formats and checks of `prompts_path`, read before any weights load),
  sampled and scored with the policy during training: after every `eval_every` updates and after
  the last update (`ppo.total_updates`); their metrics are logged at that update's step under
  `eval/` (`metrics.jsonl`, TensorBoard, W&B): `eval/score_mean` and `eval/score_std` (the
  reward), `eval/best_of_n`, `eval/reward/<name>` (each source of `rewards`), `eval/kl` (to the
  reference, summed over response tokens), `eval/entropy`, `eval/response_length`,
  `eval/distinct_1`, `eval/distinct_2` and `eval/repetition_rate`, as `jax-ppo eval` reports
  (`jax_ppo.ppo.evaluation`). Evaluation uses its own sampling key and leaves training
  unchanged. None: no evaluation during training."""
  eval_every: int = 0
  """Evaluate `eval_path` after every this many updates (and after the last update); 0: only
  after the last update. Needs `eval_path`."""
  eval_n: int = 1
  """Samples per held-out prompt (`eval/best_of_n` is the mean of each prompt's best); more than
  1 needs `eval_temperature`."""
  eval_temperature: float | None = None
  """Sampling temperature of the evaluation; None: greedy."""
  eval_seed: int = 0
  """Seed of the evaluation's sampling key (the same key at every evaluation, so evaluations
  differ only by the policy; training's keys are never used)."""
  ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
  """PPO hyperparameters. `ppo.sampling.pad_token_id` is taken from the tokenizer; empty
  `ppo.sampling.stop_token_ids` default to the tokenizer's and the model's EOS ids."""
  reward_model_path: str | None = None
  """Hugging Face `*ForSequenceClassification` folder (one label, or a cached Hub id) of the
  reward model, e.g. the export of `jax-ppo reward`. A folder without a score head
  (`score.weight`: a causal-LM checkpoint such as the SFT export) is refused before any weights
  load: its scores would be those of a random new head."""
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
  reward model, or a zero-initialised value head on the policy with a reward function. It must
  hold a score head (a reward or value model: `score.weight`), unless `value_model_new_head`."""
  value_model_new_head: bool = False
  """Start the critic from `value_model_path`'s trunk with a new value head (initialised as a
  reward head, N(0, 1/sqrt(D + 1))), e.g. from the SFT policy, a causal-LM checkpoint without
  one; a score head in the folder is then replaced. False: `value_model_path` must hold a score
  head, and a causal-LM folder is refused naming this switch."""
  reference_path: str | None = None
  """Hugging Face causal-LM folder of the reference policy of the KL penalty (loaded like the
  policy; its parameters must have the policy's shapes); default: the policy's starting weights
  (`policy_path`). Not with `lora` (the reference is then the policy's base weights)."""
  preset: str | None = None
  """Scenario preset (`jax_ppo.ppo.presets.PRESETS`) applied to `ppo` before the file's and
  the command line's values."""
  remat: str = DEFAULT_REMAT
  """Rematerialisation of each transformer layer of the policy and critic in the training
  backward pass (less memory, more compute): "dots" (the default: keep the weight matmuls'
  outputs, recompute the rest; half the temporary memory of "none" at GPT-2-small size, same
  speed), "none" (keep every intermediate), "full" (recompute the whole layer; "layer" is the
  same), "dots_all" (keep every matmul output)
  or any argument-free `jax.checkpoint_policies` name, e.g. "dots_saveable"
  (`jax_ppo.models.REMAT_POLICIES`). Gradients are the same."""
  monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
  """Thresholds of the stability monitor, PPO's hook on the run loop (`PPOTrainer(monitor=...)`);
  its collapses trigger `run.rollback`."""
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
  run: PPORunFolder = dataclasses.field(default_factory=PPORunFolder)
  """How the run folder is written and how much of the run one invocation does: checkpoints,
  samples, TensorBoard / W&B, plots, the progress bar, the rollback on a collapse
  (`PPORunFolder`; e.g. `run.updates_per_run=100 run.save_every=5`)."""

  OPERATIONAL_FIELDS: ClassVar[tuple[str, ...]] = OPERATIONAL_FIELDS
  MOVED_KEYS: ClassVar[dict[str, str]] = {f: f"run.{f}" for f in PPO_RUN_FIELDS}
  """Old flat run-folder keys -> their place in the `run` block (`jax_ppo.config_io`)."""

  def __post_init__(self):
    super().__post_init__()

    def bad(field: str, fix: str):
      raise ValueError(f"RunConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field in ("policy_path", "prompts_path"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give a path")
    check_reward_source(self)
    if self.reference_path is not None:
      if not isinstance(self.reference_path, str) or not self.reference_path:
        bad("reference_path", "give a Hugging Face model folder, or null for the policy's "
                              "starting weights")
      if self.lora is not None:
        bad("reference_path", "with lora the reference is the policy's base weights (the "
                              "adapters off, one copy); remove reference_path or lora")
    if not isinstance(self.value_model_new_head, bool):
      bad("value_model_new_head", "use true or false")
    if self.value_model_new_head and self.value_model_path is None:
      bad("value_model_new_head", "it gives value_model_path's trunk a new value head, and "
                                  "value_model_path is null; set value_model_path (e.g. the SFT "
                                  "export) or remove value_model_new_head")
    if self.preset is not None and self.preset not in PRESETS:
      bad("preset", f"choose one of {sorted(PRESETS)} or null")
    if self.remat not in REMAT_POLICIES:
      bad("remat", f"choose one of {list(REMAT_POLICIES)}")
    self._check_eval()
    self._check_placement()
    check_run_paths(inputs=self.read_paths(), run_dirs=[("RunConfig.run_dir", self.run_dir)],
                    exports=self.adapter_exports())

  def read_paths(self, prefix: str = "RunConfig") -> list[PathField]:
    """The paths the run reads, as `(field, path)` (unset fields: None): the policy (also the
    reference, and the tokenizer), the prompts, the reward models and the value model; the run
    folder must overlap none of them (`jax_ppo.runs.paths.check_run_paths`)."""
    paths = [(f"{prefix}.{f}", getattr(self, f)) for f in (
        "policy_path", "prompts_path", "eval_path", "reward_model_path", "value_model_path")]
    return paths + [(f"{prefix}.rewards[{i}].model_path", r.model_path)
                    for i, r in enumerate(self.rewards) if r.model_path is not None]

  def _check_eval(self) -> None:
    """The evaluation fields (`EVAL_FIELDS`): one ValueError naming the first bad one."""
    if self.eval_path is not None and (not isinstance(self.eval_path, str) or not self.eval_path):
      raise ValueError(f"RunConfig.eval_path={self.eval_path!r} is invalid: give a held-out "
                       "prompts file (as prompts_path), or null for no evaluation.")
    check_eval_settings(every=self.eval_every, seed=self.eval_seed, n=self.eval_n,
                        temperature=self.eval_temperature, prefix="RunConfig.eval_")
    if self.eval_path is None:
      defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in EVAL_FIELDS}
      for field in EVAL_FIELDS[1:]:
        if getattr(self, field) != defaults[field]:
          raise ValueError(
              f"RunConfig.{field}={getattr(self, field)!r} sets the evaluation on held-out "
              "prompts, but RunConfig.eval_path is null; give eval_path (a prompts file, as "
              f"prompts_path) or remove {field}.")

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
