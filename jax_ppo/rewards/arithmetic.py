"""The exact-match reward of the arithmetic task (`jax_ppo.data.arithmetic`):
`reward_function=arithmetic_exact_match` in a run config.

A response scores 1.0 when its final answer (`final_answer`) equals the exact result of the
problem its prompt states (`jax_ppo.data.arithmetic.parse_problem`: the last "What is A op B?"
of the prompt text), else 0.0. The answer is recomputed from the prompt, so the prompt records
need no answer field and any prompt stating a problem is scored the same way.

The final answer of a response:
* after the last `Answer:` marker (any case, spaces allowed before the colon), the first integer;
  a marker followed by no integer is no answer;
* without a marker, the last integer of the response;
* an integer (`NUMBER_PATTERN`) is ASCII digits with an optional sign written right before them
  (`-`, `+` or the Unicode minus `−`), thousands optionally grouped by commas (`1,234`): a sign
  counts only where it does not follow a letter, digit or `.`/`,` (so `10-3` ends with `3`, and
  `= -3` is `-3`); digits joined to letters (`x2`, `3rd`) or to a decimal part (`85.0`, `2.5`)
  are no integer. A sentence's full stop or comma after a number is fine (`is 85.`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jax_ppo.data.arithmetic import parse_problem

ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)
"""The marker before a response's stated answer (its last occurrence counts)."""
NUMBER_PATTERN = re.compile(
    r"(?<![\w.,])([-+\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(?!\w|[.,]\d)", re.ASCII)
"""An integer in a response: an optional sign, then digits (comma-grouped thousands allowed)."""


def _integers(text: str) -> list[int]:
  return [int(digits.replace(",", "")) * (-1 if sign in ("-", "\u2212") else 1)
          for sign, digits in NUMBER_PATTERN.findall(text)]


def final_answer(response: str) -> int | None:
  """The integer a response answers with (module docstring), or None when it states none.

  `final_answer("37 + 48 = 85. Answer: 85")` is 85, `final_answer("It is -1,204.")` is -1204,
  `final_answer("Answer: none")` and `final_answer("no idea")` are None.
  """
  markers = list(ANSWER_MARKER.finditer(response))
  if markers:
    found = _integers(response[markers[-1].end():])
    return found[0] if found else None
  found = _integers(response)
  return found[-1] if found else None


def exact_match(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
  """1.0 for each response whose `final_answer` is its prompt's problem's answer, else 0.0.

  Args:
    prompts: `B` prompt texts, each stating a problem ("What is 37 + 48?", as
      `jax_ppo.data.arithmetic` writes them; special tokens or a chat template around it are
      fine).
    responses: the `B` response texts, row `i` answering `prompts[i]`.

  Returns:
    `B` floats, 1.0 or 0.0.

  Raises:
    ValueError: a prompt that states no problem (naming the row and the prompt), or lists of
      different lengths.
  """
  if len(prompts) != len(responses):
    raise ValueError(f"arithmetic_exact_match got {len(prompts)} prompts and {len(responses)} "
                     "responses; give one prompt per response.")
  scores = []
  for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
    problem = parse_problem(prompt)
    if problem is None:
      raise ValueError(
          f"arithmetic_exact_match: row {row}'s prompt {prompt[:80]!r} states no arithmetic "
          "problem (\"What is A op B?\"); use prompts written by `python -m "
          "jax_ppo.data.arithmetic`, or another reward_function.")
    scores.append(1.0 if final_answer(response) == problem.answer else 0.0)
  return scores


__all__ = ["ANSWER_MARKER", "NUMBER_PATTERN", "exact_match", "final_answer"]
