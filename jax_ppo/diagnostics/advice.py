"""When a PPO, SFT or reward-model run does not fit its TPU slice: the smallest change that
makes it fit, found by re-planning.

`advise(shape, chips=..., hbm_bytes=..., peaks_of=...)` has the run's programs compiled again
(`peaks_of`, memory only: no cost variants) for one change of its config at a time, in the order
of what each change costs the run, and returns the first that fits:

1. `mesh`: FSDP over more of the slice's chips (`mesh.fsdp=f mesh.data=n/f`, the smallest `f`
   that fits): the same training, parameters, moments and the reference split `f` ways;
2. `ppo.gradient_accumulation_steps` (`sft.`, `reward.`) doubled (then x4, ...): the same
   updates, fewer rows of activations alive at a time, more sequential microbatches (while every
   chip keeps a row, or a pair of the reward model);
3. `remat=full`: every layer recomputed in the backward pass (about a third more FLOPs; PPO runs
   only: the SFT and reward-model runs have no remat field);
4. `lora.rank=16`: LoRA adapters instead of a full fine-tune (a small optimizer state, and in PPO
   no reference copy; a different algorithm);

and when no single change fits, the largest step of each together. Each `Advice` names its
config overrides (`key=value`, as `jax-ppo train`, `sft` and `reward` take them), the largest
per-chip peak and whether it fits. A planned run says where these live through its `knobs`
(`Knobs`).
Changes the config cannot express are not searched: the sampler's rollout micro-batch
(`PPOTrainer(memory_budget_bytes=...)`) and frozen models (reference, reward model) in bfloat16
(they are held in float32 beside the float32 masters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from jax_ppo.models import LoRAConfig
from jax_ppo.parallel.mesh import MeshConfig

ADVICE_LORA_RANK = 16
"""The LoRA rank `advise` proposes."""


@dataclasses.dataclass(frozen=True)
class Knobs:
  """What `advise` may change in a planned run (`RunShape.knobs`, `StageShape.knobs`)."""

  section: str
  """The run-config section of the batch geometry: "ppo", "sft" or "reward" (the overrides'
  prefix, e.g. `sft.gradient_accumulation_steps=4`)."""
  field: str
  """The shape's field that holds that section's config (replaced with the accumulation)."""
  rows: int
  """Rows (the reward model: pairs) of one optimizer step, split into the microbatches."""
  remat: bool
  """Whether the run config has a `remat` field."""


@dataclasses.dataclass(frozen=True)
class Advice:
  """One change of a run's config and what the re-planned programs need with it."""

  change: tuple[str, ...]
  """Config overrides (`key=value`) that make the change."""
  why: str
  peak_bytes_per_chip: int
  """The largest program peak per chip with the change."""
  fits: bool

  def to_json(self) -> dict:
    return {"change": list(self.change), "why": self.why,
            "peak_bytes_per_chip": self.peak_bytes_per_chip, "fits": self.fits}


def mesh_sizes(shape: Any, chips: int) -> tuple[int, int, int]:
  """`(data, fsdp, tensor)` of the run's mesh over `chips` (`-1` resolved)."""
  m = shape.mesh or MeshConfig()
  sizes = [m.data, m.fsdp, m.tensor]
  if -1 in sizes:
    known = 1
    for s in sizes:
      known *= s if s != -1 else 1
    sizes[sizes.index(-1)] = chips // known
  return sizes[0], sizes[1], sizes[2]


Step = tuple[tuple[str, ...], dict]
"""One change: its config overrides and the shape's fields it replaces."""


def single_changes(shape: Any, chips: int) -> Iterator[tuple[str, list[Step]]]:
  """The kinds of change `advise` searches (why, and each kind's steps from the smallest)."""
  data, fsdp, tensor = mesh_sizes(shape, chips)
  fsdp_steps = []
  f = fsdp * 2
  while f * tensor <= chips:
    if chips % (f * tensor) == 0:
      d = chips // (f * tensor)
      fsdp_steps.append(((f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={tensor}"),
                         {"mesh": MeshConfig(data=d, fsdp=f, tensor=tensor)}))
    f *= 2
  yield ("FSDP over more chips: parameters, moments (and PPO's frozen models) split further",
         fsdp_steps)

  knobs = shape.knobs
  c = getattr(shape, knobs.field)
  accumulation = []
  a = c.gradient_accumulation_steps * 2
  while knobs.rows % a == 0 and knobs.rows // a >= data * fsdp:
    accumulation.append(((f"{knobs.section}.gradient_accumulation_steps={a}",),
                         {knobs.field: dataclasses.replace(c, gradient_accumulation_steps=a)}))
    a *= 2
  yield "fewer rows of activations alive at a time (more sequential microbatches)", accumulation

  remat = ([] if not knobs.remat or shape.remat in ("full", "layer") else
           [(("remat=full",), {"remat": "full"})])
  yield "every layer recomputed in the backward pass (more FLOPs, fewer activations)", remat

  lora = [] if shape.lora is not None else [
      ((f"lora.rank={ADVICE_LORA_RANK}",), {"lora": LoRAConfig(rank=ADVICE_LORA_RANK)})]
  yield ("LoRA adapters: a small optimizer state (and in PPO no reference copy; a different "
         "algorithm)"), lora


def advise(shape: Any, *, chips: int, hbm_bytes: int,
           peaks_of: Callable[[Any], dict[str, int]]) -> list[Advice]:
  """The first change, in the order of the module docstring, that makes `shape` fit
  `topology`; when none does alone, the largest step of every kind together (fitting or not: the
  `Advice` says); empty when there is nothing to change.

  Args:
    shape: a run that does not fit (a `jax_ppo.diagnostics.ppo_plan.RunShape` or a
      `jax_ppo.diagnostics.stage_plan.StageShape`).
    chips: the slice's chips.
    hbm_bytes: one chip's HBM.
    peaks_of: per-program peak bytes per chip of a shape, re-planned on the slice
      (`jax_ppo.diagnostics.ppo_plan.memory_peaks`, `stage_plan.memory_peaks`).
  """
  hbm = hbm_bytes
  largest: list[Step] = []
  for why, steps in single_changes(shape, chips):
    for change, fields in steps:
      peak = max(peaks_of(dataclasses.replace(shape, **fields)).values())
      if peak <= hbm:
        return [Advice(change, why, peak, True)]
    if steps:
      largest.append(steps[-1])
  if not largest:
    return []
  change = tuple(c for step_change, _ in largest for c in step_change)
  fields = {k: v for _, step_fields in largest for k, v in step_fields.items()}
  peak = max(peaks_of(dataclasses.replace(shape, **fields)).values())
  return [Advice(change, "every change together", peak, peak <= hbm)]


__all__ = [
    "ADVICE_LORA_RANK",
    "Advice",
    "Knobs",
    "Step",
    "advise",
    "mesh_sizes",
    "single_changes",
]
