r"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections.

.. math::  y = x W + \frac{\alpha}{r}\, x A B,\qquad A \in \mathbb{R}^{d_{in} \times r},\;
   B \in \mathbb{R}^{r \times d_{out}},\; B_0 = 0

Adapters are `nnx.LoRAParam` variables (a subclass of `nnx.Param`) inside the `Linear`
modules, stacked over layers like the kernels they adapt. Training splits them from the frozen
base with `nnx.split(model, nnx.LoRAParam, ...)` (the LoRA filter must come first, since a
`LoRAParam` is also a `Param`); the reference policy is the same module called with
`use_lora=False`, so the base weights exist once in memory. `merge_lora` folds the adapters into
the kernels for export (`save_pretrained` calls it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ppo.models.layers import LORA_TARGETS, Linear


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
  """Which projections get adapters, and their size.

  Attributes:
    rank: `r`, the adapter rank.
    alpha: scale numerator; the update is `(alpha / rank) * x A B`.
    targets: projections to adapt, among `("q", "k", "v", "o", "gate", "up", "down")`.
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q", "k", "v", "o")

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank <= 0:
      raise ValueError(f"LoRAConfig.rank must be a positive int, got {self.rank!r}.")
    if not self.alpha > 0:
      raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha}.")
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if bad or not self.targets:
      raise ValueError(f"LoRAConfig.targets must be a non-empty subset of {LORA_TARGETS}, got "
                       f"{self.targets}.")


def _target_linears(model: nnx.Module, targets) -> dict[str, Linear]:
  layers = model.decoder.layers
  found = {name: getattr(layers, name, None) for name in targets}
  missing = [name for name, lin in found.items() if lin is None]
  if missing:
    raise ValueError(f"This architecture has no {missing} projection(s) to adapt.")
  return found


def add_lora(model: nnx.Module, config: LoRAConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """Adds adapters (in place) to the `config.targets` projections of every layer; returns model.

  `A` ~ N(0, 1/d_in), `B` = 0, in the parameter dtype of the adapted kernel, so the adapted
  model starts equal to its base.
  """
  for lin in _target_linears(model, config.targets).values():
    if lin.lora_a is not None:
      raise ValueError("The model already has LoRA adapters.")
    lin.add_lora(rank=config.rank, alpha=config.alpha, rngs=rngs)
  return model


def has_lora(model: nnx.Module) -> bool:
  """True when some projection of `model` carries an adapter."""
  layers = model.decoder.layers
  return any(getattr(getattr(layers, n, None), "lora_a", None) is not None for n in LORA_TARGETS)


def merge_lora(model: nnx.Module) -> nnx.Module:
  """A copy of `model` whose kernels are `W + (alpha / r) A B` and which has no adapters.

  The copy shares every non-adapted array with `model` (arrays are immutable), so it costs only
  the merged kernels. Returns `model` itself when it has no adapters.
  """
  if not has_lora(model):
    return model
  graphdef, state = nnx.split(model)
  merged = nnx.merge(graphdef, state)
  for name in LORA_TARGETS:
    lin = getattr(merged.decoder.layers, name, None)
    if lin is None or lin.lora_a is None:
      continue
    lin.kernel = nnx.Param(lin.merged_kernel().astype(lin.kernel.dtype))
    lin.lora_a = None
    lin.lora_b = None
    lin.lora_scale = 0.0
  return merged


def split_lora(model: nnx.Module):
  """`(graphdef, lora_state, base_state)`: trainable adapters and the frozen rest.

  Rebuild inside a jitted function with `nnx.merge(graphdef, lora_state, base_state)`.
  """
  return nnx.split(model, nnx.LoRAParam, ...)


def lora_param_count(model: nnx.Module) -> int:
  """Number of adapter parameters."""
  _, lora, _ = split_lora(model)
  return int(sum(jnp.size(x) for x in jax.tree.leaves(lora)))
