"""Metrics of sampled responses for evaluation: distinct-n, repetition rate, best-of-n.

Host-side NumPy/Python over the decoded samples of `PPOTrainer.evaluate_with_samples`. A
response is a string (split on whitespace into words) or a sequence of token ids (then its
tokens are the units).

* distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural
  Conversation Models"): `|unique n-grams over all responses| / |n-grams over all responses|`,
  corpus level; 1 means no n-gram occurs twice anywhere, near 0 means the policy says the same
  thing again and again.
* repetition rate: the mean over responses (with at least one n-gram) of
  `1 - |unique n-grams in the response| / |n-grams in the response|`: the fraction of a
  response's n-grams that repeat one earlier in the same response (a policy that writes
  "great great great" scores near 1).
* best-of-n: with `n` samples per prompt, the mean over prompts of the best sample's score,
  `mean_p max_i score[p, i]` (always >= the mean score).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _units(response: str | Sequence[int]) -> list:
  if isinstance(response, str):
    return response.split()
  return list(response)


def _ngrams(units: list, n: int) -> list[tuple]:
  return [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]


def _check_n(n: int) -> None:
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"n={n!r} is invalid: use an int >= 1.")


def distinct_n(responses: Sequence[str | Sequence[int]], n: int) -> float:
  """Corpus-level distinct-n: unique n-grams / all n-grams over `responses` (0.0 if none)."""
  _check_n(n)
  grams = [g for r in responses for g in _ngrams(_units(r), n)]
  return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(responses: Sequence[str | Sequence[int]], n: int = 2) -> float:
  """Mean fraction of each response's n-grams that repeat an earlier one in that response."""
  _check_n(n)
  rates = []
  for r in responses:
    grams = _ngrams(_units(r), n)
    if grams:
      rates.append(1.0 - len(set(grams)) / len(grams))
  return float(np.mean(rates)) if rates else 0.0


def best_of_n(scores: Sequence[float] | np.ndarray, n: int) -> float:
  """`mean_p max_i scores[p, i]` of scores laid out prompt-major (`n` consecutive per prompt).

  Raises:
    ValueError: the number of scores is not a multiple of `n`.
  """
  _check_n(n)
  scores = np.asarray(scores, np.float64)
  if scores.ndim != 1 or scores.size == 0 or scores.size % n:
    raise ValueError(f"best_of_n: {scores.size} scores (shape {scores.shape}) are not n={n} "
                     "samples per prompt.")
  return float(scores.reshape(-1, n).max(axis=1).mean())


__all__ = ["best_of_n", "distinct_n", "repetition_rate"]
