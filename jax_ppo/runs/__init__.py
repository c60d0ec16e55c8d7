"""jax_ppo.runs: the stages run from config files, as the `jax-ppo` command line runs them.

`common` (what the runs share: the run-config base and its `run` block, record files, model
folders, dtypes), `paths` (no run writes over what it reads), `context` (lengths against a
model's context), `run_folders` (which stage wrote a run folder), `ppo_config`
(`RunConfig`), `ppo` (`run_training`, evaluation and export of run folders), `sft`, `reward`,
`dpo`, `pipeline` (SFT -> reward model -> PPO from one file).
"""

from jax_ppo.runs.ppo import build_trainer, evaluate_run, export_run, run_training
from jax_ppo.runs.ppo_config import RunConfig, load_run_config

__all__ = [
    "RunConfig",
    "build_trainer",
    "evaluate_run",
    "export_run",
    "load_run_config",
    "run_training",
]
