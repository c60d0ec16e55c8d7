"""Reward specs of a run config: built-in rewards, `package.module:function` rewards, and the
weighted sources of `RunConfig.rewards` (issue 10 item 7).

`parse_reward_function` checks a spec's syntax (nothing imported), `import_reward_function`
imports a user's function safely, `reward_function` builds its scorer; `RewardSource` is one
weighted term of a combined reward (`jax_ppo.rewards.scorers.CombinedScorer`). Re-exported by
`jax_ppo.runs.ppo`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import keyword
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from jax_ppo.rewards import arithmetic
from jax_ppo.rewards.scorers import FunctionScorer, TokenScorer

REWARD_FUNCTIONS: Mapping[str, str] = {
    "length": "number of response tokens (the stop token included)",
    "count:<token>": "occurrences in the response of <token>: a token of the policy's "
                     "vocabulary (its string, e.g. count:Ġgood) or an id (count:42)",
    "arithmetic_exact_match": "1.0 when the response's final integer (after its last "
                              "'Answer:', else its last integer) is the exact result of the "
                              "'What is A op B?' its prompt states, else 0.0 (prompts of "
                              "`python -m jax_ppo.data.arithmetic`; jax_ppo.rewards.arithmetic)",
}
"""Built-in programmatic rewards for `RunConfig.reward_function`: spec -> description."""


MODULE_REWARD = "package.module:function"
"""The third kind of `RunConfig.reward_function`: a Python function of texts,
`fn(prompts: list[str], responses: list[str]) -> sequence of B floats`, imported from an
installed (or PYTHONPATH) module. Only the named module is imported (`importlib.import_module`;
nothing in the string is evaluated), the function must be defined in it (or a submodule), and
standard-library and jax_ppo modules are refused. A config naming a module runs that module's code
on import: treat such configs like code."""


def _is_dotted_identifier(text: str) -> bool:
  return bool(text) and all(part.isidentifier() and not keyword.iskeyword(part)
                            for part in text.split("."))


def parse_reward_function(spec: str) -> tuple[str, str | None]:
  """`"count:good"` -> `("count", "good")`, `"pkg.mod:fn"` -> `("pkg.mod", "fn")`.

  Only the syntax is checked (nothing is imported): built-in names first (`REWARD_FUNCTIONS`),
  then `package.module:function` with identifiers only.

  Raises:
    ValueError: naming the spec and listing the accepted forms.
  """
  if not isinstance(spec, str):
    raise ValueError(f"RunConfig.reward_function={spec!r} is invalid: give a name.")
  name, sep, arg = spec.partition(":")
  names = {k.partition(":")[0]: ":" in k for k in REWARD_FUNCTIONS}
  if name in names:
    if names[name] != bool(sep) or (sep and not arg):
      usage = next(k for k in REWARD_FUNCTIONS if k.partition(":")[0] == name)
      raise ValueError(f"RunConfig.reward_function={spec!r} is invalid: write it as {usage!r}.")
    return name, (arg if sep else None)
  if sep and _is_dotted_identifier(name) and arg.isidentifier() and not keyword.iskeyword(arg):
    if arg.startswith("__"):
      raise ValueError(f"RunConfig.reward_function={spec!r} is invalid: {arg!r} is a special "
                       "attribute, not a reward function; name a function defined in the module.")
    return name, arg
  raise ValueError(
      f"RunConfig.reward_function={spec!r} is invalid: unknown reward function {name!r}; "
      f"choose one of {', '.join(REWARD_FUNCTIONS)}, or {MODULE_REWARD} (identifiers only, "
      "e.g. my_rewards.sentiment:score), or give reward_model_path instead."
  )


def import_reward_function(spec: str) -> Callable[[list, list], Any]:
  """Imports the function named by a `"package.module:function"` reward spec.

  Imports exactly the named module (its parent packages are imported by Python as usual), with
  the `sys.path` as it is: the working directory or the config's folder is not added. Nothing in
  the spec is evaluated.

  Raises:
    ValueError: a built-in spec, a standard-library or jax_ppo module, a module that does not
      import, a missing attribute, a function defined in another module, or a non-callable.
  """
  module_name, function = parse_reward_function(spec)
  where = f"RunConfig.reward_function={spec!r} is invalid"
  if module_name in {k.partition(":")[0] for k in REWARD_FUNCTIONS}:
    raise ValueError(f"{where}: it is a built-in reward, not a module function.")
  top = module_name.partition(".")[0]
  if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "jax_ppo":
    raise ValueError(
        f"{where}: {module_name!r} is a {'jax_ppo' if top == 'jax_ppo' else 'standard-library'} "
        f"module, not a reward function module; write fn(prompts, responses) -> scores in your "
        "own module and name it as package.module:function."
    )
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    raise ValueError(
        f"{where}: no module named {e.name!r}; install the package, or put its folder on "
        "PYTHONPATH (the working directory is not searched by the jax-ppo command)."
    ) from None
  except Exception as e:
    raise ValueError(f"{where}: importing {module_name!r} failed with {type(e).__name__}: "
                     f"{e}.") from e
  if not hasattr(module, function):
    public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                    and not isinstance(v, type) and getattr(v, "__module__", None) == module_name)
    close = difflib.get_close_matches(function, public, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{where}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                     f"has no attribute {function!r}{hint}; its functions: {public or 'none'}.")
  fn = getattr(module, function)
  if isinstance(fn, type) or not callable(fn):
    raise ValueError(f"{where}: {module_name}.{function} is a {type(fn).__name__}, not a "
                     "function; name a function fn(prompts, responses) -> scores.")
  defined_in = getattr(fn, "__module__", None) or type(fn).__module__
  if defined_in != module_name and not str(defined_in).startswith(module_name + "."):
    raise ValueError(
        f"{where}: {function!r} is defined in {defined_in!r}, not in {module_name!r} (it is "
        f"imported there); name the module that defines it ({defined_in}:{function})."
    )
  return fn


def reward_function(spec: str, tokenizer: Any = None) -> TokenScorer | FunctionScorer:
  """The scorer of a `RunConfig.reward_function`: a built-in (`REWARD_FUNCTIONS`, a jittable
  `TokenScorer`) or a `package.module:function` (`import_reward_function`, a `FunctionScorer` on
  the decoded texts; `arithmetic_exact_match` is such a scorer too, and needs the tokenizer)."""
  name, arg = parse_reward_function(spec)
  if name not in {k.partition(":")[0] for k in REWARD_FUNCTIONS}:
    return FunctionScorer(import_reward_function(spec), tokenizer=tokenizer, name=spec)
  if name == "arithmetic_exact_match":
    if tokenizer is None:
      raise ValueError(f"RunConfig.reward_function={spec!r} scores decoded texts: give the "
                       "policy's tokenizer.")
    return FunctionScorer(arithmetic.exact_match, tokenizer=tokenizer, name=spec)
  if name == "length":
    def length(prompt_ids, prompt_mask, response_ids, response_mask):
      return jnp.sum(response_mask, axis=1).astype(jnp.float32)

    return TokenScorer(length, name=spec)
  vocab = tokenizer.get_vocab() if tokenizer is not None else {}
  if arg in vocab:
    token_id = int(vocab[arg])
  elif arg.isdigit():
    token_id = int(arg)
  else:
    ids = tokenizer(arg, add_special_tokens=False)["input_ids"] if tokenizer is not None else []
    if len(ids) != 1 or ids[0] == getattr(tokenizer, "unk_token_id", None):
      raise ValueError(
          f"RunConfig.reward_function={spec!r} is invalid: {arg!r} is not one token of the "
          f"policy's tokenizer (it encodes to {ids}); give a vocabulary entry or a token id."
      )
    token_id = int(ids[0])

  def count(prompt_ids, prompt_mask, response_ids, response_mask):
    return jnp.sum((response_ids == token_id) & response_mask, axis=1).astype(jnp.float32)

  return TokenScorer(count, name=spec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSource:
  """One term of a combined reward (`RunConfig.rewards`): exactly one of `function` and
  `model_path`, times `weight`. Its raw score is logged as `reward/<name>`."""

  function: str | None = None
  """A built-in (`REWARD_FUNCTIONS`) or "package.module:function" (`MODULE_REWARD`)."""
  model_path: str | None = None
  """Hugging Face `*ForSequenceClassification` folder (one label) of a reward model, or a cached
  Hub id `org/name` (`jax_ppo.runs.common.resolve_model_paths`)."""
  weight: float = 1.0
  """Multiplier of this source's raw score in the sum (negative: a penalty)."""
  name: str | None = None
  """Metric name (`reward/<name>`); default: the function spec, or "reward_model" (then
  "reward_model_2", ...)."""

  def __post_init__(self):
    if (self.function is None) == (self.model_path is None):
      raise ValueError(
          f"RewardSource needs exactly one of function (one of {', '.join(REWARD_FUNCTIONS)}, "
          f"or {MODULE_REWARD}) and model_path (a reward-model folder); got "
          f"function={self.function!r}, model_path={self.model_path!r}."
      )
    if self.function is not None:
      parse_reward_function(self.function)
    if self.model_path is not None and (not isinstance(self.model_path, str)
                                        or not self.model_path):
      raise ValueError(f"RewardSource.model_path={self.model_path!r} is invalid: give a path.")
    if (isinstance(self.weight, bool) or not isinstance(self.weight, int | float)
        or not math.isfinite(self.weight)):
      raise ValueError(f"RewardSource.weight={self.weight!r} is invalid: give a finite number.")
    if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()
                                  or any(c.isspace() for c in self.name)):
      raise ValueError(f"RewardSource.name={self.name!r} is invalid: give a name without "
                       "spaces, or null.")


def reward_source_names(sources: Sequence[RewardSource]) -> list[str]:
  """The metric names of `sources` (`RewardSource.name`, else a default); unique or an error."""
  names: list[str] = []
  models = 0
  for i, source in enumerate(sources):
    if source.name is not None:
      name = source.name
    elif source.function is not None:
      name = source.function
    else:
      models += 1
      name = "reward_model" if models == 1 else f"reward_model_{models}"
    if name in names:
      raise ValueError(f"RunConfig.rewards[{i}]: the name {name!r} is used twice; set "
                       f"rewards[{i}].name to a distinct name.")
    names.append(name)
  return names


__all__ = [
    "MODULE_REWARD",
    "REWARD_FUNCTIONS",
    "RewardSource",
    "import_reward_function",
    "parse_reward_function",
    "reward_function",
    "reward_source_names",
]
