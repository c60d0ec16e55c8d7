"""The quickstart: the whole RLHF pipeline on a synthetic review task, in minutes on a CPU.

A policy learns to write short English product reviews of more positive sentiment:

1. `data`: a synthetic review corpus (`jax_ppo.quickstart.reviews`) and a byte-level BPE tokenizer
   trained on it (`jax_ppo.quickstart.tokenizer_training`);
2. `sft`: a tiny Llama-style model, randomly initialised, trained by SFT on the reviews;
3. `pairs`: two SFT-policy samples per review opening, labelled by the gold scorer plus
   Bradley-Terry noise;
4. `reward_model`: a Bradley-Terry reward model on the SFT trunk, normalised so SFT samples
   score with mean 0 and std 1;
5. `ppo`: PPO with the reward model and a KL penalty against the SFT model.

`run_quickstart(config, out)` runs the stages that are not yet done (see
`jax_ppo.quickstart.stages` for the output layout), writes the plots and returns the summary;
`experiments/quickstart.py` is its command line.
"""

from jax_ppo.quickstart.config import QuickstartConfig, smoke
from jax_ppo.quickstart.pipeline import run_quickstart

__all__ = ["QuickstartConfig", "run_quickstart", "smoke"]
