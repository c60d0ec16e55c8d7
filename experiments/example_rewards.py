"""An example `module:function` reward for `RunConfig.reward_function` (GRPO/PPO without a
reward model): `reward_function: example_rewards:positive_words` with `PYTHONPATH=experiments`.

A reward function takes the prompts and the responses as texts and returns one float per
response. This one counts positive minus negative sentiment words and caps the count, so
repeating one positive word does not keep paying.
"""

from __future__ import annotations

POSITIVE = frozenset("good great fun liked love loved excellent wonderful enjoyable".split())
NEGATIVE = frozenset("bad dull boring hated awful terrible poor worst".split())


def positive_words(prompts: list[str], responses: list[str]) -> list[float]:
  """Per response: (distinct positive words - distinct negative words), clipped to [-3, 3]."""
  del prompts
  scores = []
  for response in responses:
    words = {w.strip(".,!?;:").lower() for w in response.split()}
    score = len(words & POSITIVE) - len(words & NEGATIVE)
    scores.append(float(max(-3, min(3, score))))
  return scores
