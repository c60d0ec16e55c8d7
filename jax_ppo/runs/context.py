"""Lengths checked against a model's context before any weights load.

A model's context is `max_position_embeddings` of its `config.json` (read with
`jax_ppo.models.load_config`, which reads no weights). GPT-2's learned position table has exactly
that many rows; for a RoPE model (Llama, Qwen, Mistral, ...) the number is informative, but a
model is not trained past it, so a run is refused there too: a user who knows their checkpoint
handles longer sequences raises the value in its `config.json` deliberately.

* `check_fits_context`: a length field (`SFTRunConfig.sft.max_length`,
  `RewardRunConfig.reward.max_length`) against the context of the model it trains;
* `prompt_token_budget`: the tokens a prompt may have when `max_new_tokens` follow it in the
  policy's context (PPO, `jax-ppo eval`, the reward stage's normalisation samples).

Each refusal is one ValueError line naming the field, both numbers and the fix.
"""

from __future__ import annotations

from typing import Any


def _raise_note(model_config: Any) -> str:
  """How the context may be raised, by the model's kind of positions."""
  if getattr(model_config, "position_embedding", "rope") == "learned":
    return ("the model's learned position table has exactly that many rows, so it cannot be "
            "raised")
  return ("the model uses RoPE: if it handles longer sequences, raise max_position_embeddings in "
          "its config.json deliberately")


def check_fits_context(field: str, length: int, model_config: Any, *, model_field: str,
                       model_path: str) -> None:
  """Nothing when `length` tokens fit the model's context; otherwise one ValueError line.

  Args:
    field: the length's config field, as errors name it (e.g. "SFTRunConfig.sft.max_length").
    length: the tokens per row the run would use.
    model_config: the model's `jax_ppo.models.ModelConfig` (`load_config(path)`).
    model_field: the config field of the model folder (e.g. "SFTRunConfig.model_path").
    model_path: the model folder.

  Raises:
    ValueError: `length` > `model_config.max_position_embeddings`, naming `field`, both numbers,
      the model folder and the fix.
  """
  context = int(model_config.max_position_embeddings)
  if int(length) > context:
    raise ValueError(
        f"{field}={length} is longer than the context of {model_field}={model_path!r} "
        f"(max_position_embeddings={context} in its config.json): rows past it would attend "
        f"beyond the positions the model was trained on; lower {field.split('.', 1)[-1]} to "
        f"{context} or less ({_raise_note(model_config)})."
    )


def prompt_token_budget(policy_config: Any, max_new_tokens: int, *,
                        field: str = "PPOConfig.sampling.max_new_tokens",
                        fix: str = "lower ppo.sampling.max_new_tokens") -> int:
  """Tokens a prompt may have: the policy's context `max_position_embeddings` minus
  `max_new_tokens`.

  Args:
    policy_config: the policy's `jax_ppo.models.ModelConfig` (`load_config(path)`).
    max_new_tokens: the response length limit.
    field: how the error names `max_new_tokens`.
    fix: the error's fix.

  Raises:
    ValueError: `max_new_tokens` leaves no room for a prompt (the budget would be < 1), naming
      `field`, both numbers and `fix`.
  """
  budget = int(policy_config.max_position_embeddings) - int(max_new_tokens)
  if budget < 1:
    raise ValueError(
        f"{field}={max_new_tokens} leaves no room for a prompt in the policy's context of "
        f"{policy_config.max_position_embeddings} tokens; {fix}."
    )
  return budget


__all__ = ["check_fits_context", "prompt_token_budget"]
