"""Arithmetic problems generated from a seed: a verifiable-reward task shipped with the package.

A problem is `a op b` with operands `0 <= a, b < 10**digits` and `op` one of `+`, `-`, `*`
(`ArithmeticConfig`); its reference answer is the exact integer result (negative for `a < b`
under `-`). Its prompt is `"Q: What is 37 + 48?\\nA:"` and its worked answer (the SFT response)
`" 37 + 48 = 85. Answer: 85"`; `jax_ppo.rewards.arithmetic` scores a response 1.0 when its final
number is the answer.

Nothing is downloaded and nothing depends on Python's `random`: draw `k` of seed `s` is read from
the BLAKE2b hash of `"s/k"`, so the same seed gives the same problems on every machine and Python
version. The split is a property of the problem itself: a problem is held out (`"eval"`) when
the hash of its text `"37 + 48"` falls in one of `HOLDOUT_BUCKETS` buckets (1 in 10), so the
train and held-out files never share a problem, whatever seeds and counts wrote them.

The files are the ones a run reads (`jax_ppo.data.files`): prompt records `{"prompt", "answer"}`
for `prompts_path` / `eval_path` (the reader keeps the prompt; `answer` is for people, the reward
parses the problem back from the prompt text, `parse_problem`) and SFT records `{"prompt",
"response", "answer"}` so a small model can first learn the format:

  python -m jax_ppo.data.arithmetic --out data/arithmetic --seed 0 --train 2000 --eval 200
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

OPERATIONS = ("+", "-", "*")
"""The operations a problem may use."""
SPLITS = ("train", "eval")
"""The two splits: training problems and held-out problems."""
HOLDOUT_BUCKETS = (0, 10)
"""A problem is held out when the hash of its text, modulo the second number, is the first."""
MAX_DIGITS = 9
"""The most digits an operand may have."""

PROMPT_TEMPLATE = "Q: What is {a} {op} {b}?\nA:"
"""The prompt text of problem `a op b`."""
PROBLEM_PATTERN = re.compile(r"what\s+is\s+(\d+)\s*([-+*])\s*(\d+)\s*\?", re.IGNORECASE)
"""How `parse_problem` finds a problem in a prompt text (its last match; any case, any spacing,
so a tokenizer's decode or a chat template around it does not hide it)."""

FILES = {"train": "train.jsonl", "eval": "eval.jsonl", "sft_train": "sft_train.jsonl",
         "sft_eval": "sft_eval.jsonl"}
"""The files `write_task` writes into its folder: prompts of each split and SFT records of each."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
  """Which problems are drawn."""

  digits: int = 2
  """Most digits of an operand: operands are drawn uniformly from 0 to 10**digits - 1."""
  operations: tuple[str, ...] = OPERATIONS
  """The operations drawn (uniformly), a non-empty subset of `OPERATIONS` without repeats."""

  def __post_init__(self):
    if (isinstance(self.digits, bool) or not isinstance(self.digits, int)
        or not 1 <= self.digits <= MAX_DIGITS):
      raise ValueError(f"ArithmeticConfig.digits={self.digits!r} is invalid: give an integer "
                       f"from 1 to {MAX_DIGITS}.")
    ops = self.operations
    if (isinstance(ops, str) or not isinstance(ops, Sequence) or not ops
        or any(op not in OPERATIONS for op in ops) or len(set(ops)) != len(ops)):
      raise ValueError(f"ArithmeticConfig.operations={ops!r} is invalid: give a non-empty "
                       f"selection of {OPERATIONS} without repeats, e.g. ('+', '-').")
    object.__setattr__(self, "operations", tuple(ops))

  @property
  def space(self) -> int:
    """How many distinct problems there are (both splits together)."""
    return (10 ** self.digits) ** 2 * len(self.operations)


class Problem(NamedTuple):
  """One problem `a op b` (`a`, `b` >= 0 integers, `op` in `OPERATIONS`)."""

  a: int
  op: str
  b: int

  @property
  def text(self) -> str:
    """`"37 + 48"`: the canonical text the split hash reads."""
    return f"{self.a} {self.op} {self.b}"

  @property
  def answer(self) -> int:
    """The exact result."""
    if self.op == "+":
      return self.a + self.b
    if self.op == "-":
      return self.a - self.b
    return self.a * self.b

  @property
  def prompt(self) -> str:
    """The prompt text (`PROMPT_TEMPLATE`)."""
    return PROMPT_TEMPLATE.format(a=self.a, op=self.op, b=self.b)

  @property
  def worked_answer(self) -> str:
    """The SFT response: `" 37 + 48 = 85. Answer: 85"` (leading space: it continues "A:")."""
    return f" {self.text} = {self.answer}. Answer: {self.answer}"

  @property
  def split(self) -> str:
    """`"eval"` for a held-out problem (`HOLDOUT_BUCKETS`), else `"train"`."""
    digest = hashlib.blake2b(self.text.encode(), digest_size=8).digest()
    bucket, buckets = HOLDOUT_BUCKETS
    return "eval" if int.from_bytes(digest, "big") % buckets == bucket else "train"


def parse_problem(prompt: str) -> Problem | None:
  """The problem stated in a prompt text: the last `"What is A op B?"` in it (any case and
  spacing, `PROBLEM_PATTERN`), or None when there is none. Reads the prompts `Problem.prompt`
  writes, also decoded by a tokenizer (special tokens around them) or inside a chat template."""
  matches = PROBLEM_PATTERN.findall(prompt)
  if not matches:
    return None
  a, op, b = matches[-1]
  return Problem(int(a), op, int(b))


def _draws(seed: int, config: ArithmeticConfig) -> Iterator[Problem]:
  """The endless, deterministic stream of problems of `seed` (repeats included)."""
  n, ops = 10 ** config.digits, config.operations
  k = 0
  while True:
    h = int.from_bytes(hashlib.blake2b(f"{seed}/{k}".encode(), digest_size=16).digest(), "big")
    yield Problem(h % n, ops[(h // (n * n)) % len(ops)], (h // n) % n)
    k += 1


def generate(count: int, *, split: str, seed: int = 0,
             config: ArithmeticConfig | None = None) -> list[Problem]:
  """`count` distinct problems of `split`, in the order seed `seed` draws them.

  Args:
    count: how many problems (>= 0).
    split: `"train"` or `"eval"` (`Problem.split`); the two never share a problem.
    seed: any integer; the same seed, count and config give the same list on every machine, and
      a larger count extends a smaller one's list.
    config: operand digits and operations (default `ArithmeticConfig()`).

  Raises:
    ValueError: a bad split, count or seed, or more problems than the split holds (about 10% of
      `config.space` are held out): naming the number and the fix.
  """
  config = config or ArithmeticConfig()
  if split not in SPLITS:
    raise ValueError(f"split={split!r} is invalid: give one of {SPLITS}.")
  if isinstance(count, bool) or not isinstance(count, int) or count < 0:
    raise ValueError(f"count={count!r} of {split} problems is invalid: give an integer >= 0.")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise ValueError(f"seed={seed!r} is invalid: give an integer.")
  share = HOLDOUT_BUCKETS[1] if split == "eval" else HOLDOUT_BUCKETS[1] / (HOLDOUT_BUCKETS[1] - 1)
  # Stop after enough draws to have seen nearly all of a small space (a coupon-collector bound).
  limit = 64 * (count + 1) + 40 * config.space
  seen: set[Problem] = set()
  out: list[Problem] = []
  for k, problem in enumerate(_draws(seed, config)):
    if len(out) == count:
      return out
    if k >= limit:
      break
    if problem not in seen:
      seen.add(problem)
      if problem.split == split:
        out.append(problem)
  raise ValueError(
      f"Asked for {count} {split} problems, but only {len(out)} distinct ones were drawn from "
      f"the about {int(config.space / share)} {split} problems of digits={config.digits}, "
      f"operations={''.join(config.operations)}; ask for fewer, or raise digits or add "
      "operations.")


def write_prompts(path: str | os.PathLike, problems: Sequence[Problem]) -> pathlib.Path:
  """Writes prompt records `{"prompt": str, "answer": int}`, one JSON object a line (the JSONL a
  run's `prompts_path` / `eval_path` reads); returns the path."""
  return _write(path, ({"prompt": p.prompt, "answer": p.answer} for p in problems))


def write_sft(path: str | os.PathLike, problems: Sequence[Problem]) -> pathlib.Path:
  """Writes SFT records `{"prompt": str, "response": str, "answer": int}` (the response
  `Problem.worked_answer`), the JSONL an SFT run's `train_path` reads; returns the path."""
  return _write(path, ({"prompt": p.prompt, "response": p.worked_answer, "answer": p.answer}
                       for p in problems))


def _write(path: str | os.PathLike, records) -> pathlib.Path:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
  tmp.replace(path)  # complete or absent
  return path


def write_task(out: str | os.PathLike, *, seed: int = 0, train: int = 2000, eval: int = 200,
               config: ArithmeticConfig | None = None) -> dict[str, pathlib.Path]:
  """Writes the task's four files (`FILES`) into folder `out` (created; the files replaced):
  `train` training and `eval` held-out problems of `seed`, each as prompts and as SFT records.

  Returns:
    `FILES`' keys -> the written paths.

  Raises:
    ValueError: from `generate` (a count the split cannot hold, a bad seed).
  """
  problems = {split: generate(n, split=split, seed=seed, config=config)
              for split, n in (("train", train), ("eval", eval))}
  out = pathlib.Path(out)
  paths = {}
  for split, chosen in problems.items():
    paths[split] = write_prompts(out / FILES[split], chosen)
    paths[f"sft_{split}"] = write_sft(out / FILES[f"sft_{split}"], chosen)
  return paths


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m jax_ppo.data.arithmetic --out DIR [--seed 0] [--train 2000] [--eval 200]
  [--digits 2] [--operations +-*]`: writes `write_task`'s files and prints their paths. A bad
  argument exits with status 2 and one line naming it."""
  parser = argparse.ArgumentParser(
      prog="python -m jax_ppo.data.arithmetic",
      description="Write seeded arithmetic problems: train.jsonl and eval.jsonl (prompts for "
                  "prompts_path / eval_path, scored by reward_function=arithmetic_exact_match) "
                  "and sft_train.jsonl, sft_eval.jsonl (prompt + worked answer).")
  parser.add_argument("--out", required=True, help="folder to write the four files into")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--train", type=int, default=2000, help="training problems")
  parser.add_argument("--eval", type=int, default=200, help="held-out problems")
  parser.add_argument("--digits", type=int, default=2, help="most digits of an operand")
  parser.add_argument("--operations", default="".join(OPERATIONS),
                      help="operations to draw, e.g. +- (default +-*)")
  args = parser.parse_args(argv)
  try:
    config = ArithmeticConfig(digits=args.digits, operations=tuple(args.operations))
    paths = write_task(args.out, seed=args.seed, train=args.train, eval=args.eval,
                       config=config)
  except ValueError as e:
    parser.error(str(e))
  for key, path in paths.items():
    print(f"{key}: {path}")
  return 0


__all__ = [
    "FILES",
    "HOLDOUT_BUCKETS",
    "MAX_DIGITS",
    "OPERATIONS",
    "PROBLEM_PATTERN",
    "PROMPT_TEMPLATE",
    "SPLITS",
    "ArithmeticConfig",
    "Problem",
    "generate",
    "main",
    "parse_problem",
    "write_prompts",
    "write_sft",
    "write_task",
]


if __name__ == "__main__":
  raise SystemExit(main())
