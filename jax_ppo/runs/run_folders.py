"""Which stage wrote a run folder, so that a folder given to another verb is one clear line.

Every run folder holds the configuration it was trained with, whole (`config.yaml`, written by
the run loop with `jax_ppo.config_io.save_config`): a PPO run's (`jax-ppo train`) has the `ppo`
block, an SFT run's (`jax-ppo sft`) the `sft` block, a reward-model run's (`jax-ppo reward`) the
`reward` block, a DPO run's (`jax-ppo dpo`) the `dpo` block, and no run config has another's
block. `run_folder_stage` reads which stage that
is; `check_run_folder_stage` refuses, before anything loads, a folder of another stage given to a
verb (`jax-ppo eval` or `export` pointed at an SFT run, `jax-ppo train` resuming a reward-model
run's folder), naming the stage that wrote it and what to give instead.
"""

from __future__ import annotations

import os
import pathlib

from jax_ppo.config_io import CONFIG_FILENAME, read_config_file

STAGE_COMMANDS = {"ppo": "jax-ppo train", "sft": "jax-ppo sft", "reward": "jax-ppo reward",
                  "dpo": "jax-ppo dpo"}
"""Stage -> the command that trains it (and writes its run folders)."""


def _saved_config(run_dir: str | os.PathLike) -> dict | None:
  """The mapping of `run_dir/config.yaml`; None when absent or unreadable."""
  path = pathlib.Path(run_dir) / CONFIG_FILENAME
  if not path.is_file():
    return None
  try:
    data = read_config_file(path)
  except (ValueError, OSError):
    return None
  return data if isinstance(data, dict) else None


def run_folder_stage(run_dir: str | os.PathLike) -> str | None:
  """The stage ("ppo", "sft" or "reward") whose run wrote `run_dir`, from the block its
  `config.yaml` holds; None when the folder has no readable config of one stage (absent, not a
  mapping, invalid YAML: the verb's own loading reports those)."""
  data = _saved_config(run_dir)
  found = [stage for stage in STAGE_COMMANDS if data is not None and stage in data]
  return found[0] if len(found) == 1 else None


def check_run_folder_stage(run_dir: str | os.PathLike, stage: str, *, field: str,
                           verb: str | None = None) -> None:
  """Nothing when `run_dir` is absent, new, or a run folder of `stage`; otherwise one ValueError
  line naming the stage that wrote it and what to use instead.

  Args:
    run_dir: the run folder given to the verb.
    stage: the stage the verb reads or writes ("ppo", "sft", "reward").
    field: how the error names the folder (e.g. "--run-dir", "SFTRunConfig.run_dir").
    verb: the command that reads the folder (e.g. "jax-ppo eval"); None: the stage's own
      command, which trains in it (or resumes it).

  Raises:
    ValueError: e.g. "--run-dir='runs/sft' is a run folder of `jax-ppo sft` (stage sft), not of
      `jax-ppo train`; use the run_dir of a `jax-ppo train` run (`jax-ppo eval` reads those; this
      run's model is exported to 'runs/sft/hf_model' when it is complete)."
  """
  found = run_folder_stage(run_dir)
  if found is None or found == stage:
    return
  own, other = STAGE_COMMANDS[stage], STAGE_COMMANDS[found]
  where = f"{field}={str(run_dir)!r} is a run folder of `{other}` (stage {found}), not of `{own}`"
  if verb is None:
    raise ValueError(f"{where}; use a new folder for this run (or resume that run with "
                     f"`{other}`).")
  export = (_saved_config(run_dir) or {}).get("export_dir") or os.path.join(run_dir, "hf_model")
  model = (f"; this run's model is exported to {str(export)!r} when it is complete"
           if found != "ppo" else "")
  raise ValueError(f"{where}; use the run_dir of a `{own}` run (`{verb}` reads those{model}).")


__all__ = ["STAGE_COMMANDS", "check_run_folder_stage", "run_folder_stage"]
