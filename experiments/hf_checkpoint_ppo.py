"""SFT, then a reward model, then PPO, on any local Hugging Face checkpoint and your data files.

Usage:
  python experiments/hf_checkpoint_ppo.py experiments/configs/pipeline.yaml \\
      model_path=models/Qwen3-0.6B sft.train_path=data/sft.jsonl \\
      reward.train_path=data/preferences.jsonl ppo.prompts_path=data/prompts.jsonl

The YAML names one config per stage (a file or an inline mapping; `jax_ppo.runs.pipeline`
says how they connect); `key=value` overrides start with the stage
(`sft.sft.optimizer.learning_rate=1e-5`, `ppo.ppo.total_updates=50`). Each stage trains in its
own run folder and exports a Hugging Face folder that the next stage starts from; the same
command run again resumes where it stopped.
Prints one JSON line per stage (with its time) and exits 2 on bad input with one line naming the
field and the fix.
"""

from __future__ import annotations

import json
import logging
import sys

from jax_ppo.checkpoint import CheckpointError
from jax_ppo.runs.pipeline import load_pipeline, run_pipeline


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0 if argv else 2
  if not logging.getLogger().handlers:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax_ppo").setLevel(logging.INFO)
  try:
    configs = load_pipeline(argv)
    summaries = run_pipeline(configs, report=lambda s: print(json.dumps(s), flush=True))
  except (ValueError, OSError, CheckpointError) as e:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"hf_checkpoint_ppo: error: {text or type(e).__name__}", file=sys.stderr)
    return 2
  if summaries and not summaries[-1]["complete"]:
    print(f"hf_checkpoint_ppo: stage {summaries[-1]['stage']} is not complete; run the same "
          "command again to continue.", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
