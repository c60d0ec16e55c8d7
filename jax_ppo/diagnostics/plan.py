"""A run's programs compiled ahead of time for a TPU slice or GPU nodes, from a CPU host: what
every stage's plan shares.

A stage's plan (`jax_ppo.diagnostics.ppo_plan` for PPO) builds its state and batches as abstract
`jax.ShapeDtypeStruct`s with the run's shardings over the slice's devices
(`topology_devices`: `jax_ppo.diagnostics.topology` for TPUs, `gpu_topology` for GPUs), hands
each program here as a `Program` and gets back, per program and per chip,
`compiled.memory_analysis()` (argument, output, aliased and temporary bytes) and its
loop-corrected costs. The chip's peak use during a program is

.. math::  \\text{peak} = \\text{arguments} + \\text{outputs} - \\text{aliased}
           + \\text{temporaries} + \\text{resident arrays the program does not take}

(the optimizer state and the reference stay on the chip while the sampler runs); a run `fits`
when every program's peak is at most the chip's HBM (`jax_ppo.parallel.chips`) on a TPU, and at
most the share of it JAX's allocator takes on a GPU (`gpu_topology.allocator_fraction`: 75% by
default; the advice then raises it first: `fraction_advice`).

Loops. XLA's cost analysis counts the body of a `while` loop (every `lax.scan` and
`lax.while_loop`) once, whatever its trip count. The costs are therefore taken from variants
compiled with the layers unrolled at depth 1 and 2 and extrapolated in depth (every layer has
the same shapes), `C(L) = C(1) + (L - 1) (C(2) - C(1))` (`depth_costs`); each stage adds its
other loops' missing trips from their bodies compiled alone. The roofline time of a program is
`max(F / F_peak, Q / W_HBM)` on one chip (`chips.roofline_seconds`), the compute dtype choosing
the peak's row.

For a TPU slice libtpu must be installed (`pip install "jax_ppo[tpu]"`, best in a virtual
environment of its own: with it every JAX process tries to start a TPU runtime) and only one
process on a host may load it at a time (its lock file, `libtpu_lockfile` in the temporary
folder). For GPUs, JAX's CUDA plugin (`jax_ppo[plan-gpu]`); XLA's GPU compiler gives no cost
analysis without a GPU, so a GPU plan's programs have memory and no costs (None).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jax_ppo.diagnostics.advice import Advice, advise
from jax_ppo.diagnostics.gpu_topology import (
    DEFAULT_MEM_FRACTION,
    MEM_FRACTION_VARS,
    RAISED_MEM_FRACTION,
    allocator_fraction,
    gpu_devices,
    is_gpu_topology,
    require_cuda_plugin,
)
from jax_ppo.diagnostics.memory import shard_bytes
from jax_ppo.diagnostics.topology import PlanError, require_libtpu, slice_mesh, tpu_devices
from jax_ppo.models import ModelConfig
from jax_ppo.parallel.chips import Chip, chip_for, roofline_seconds
from jax_ppo.parallel.mesh import AXES

# ---- costs ---------------------------------------------------------------------------------


def with_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
  """`config` cut to its first `num_layers` layers (same widths)."""
  sliding = config.sliding_layers
  return dataclasses.replace(config, num_layers=num_layers,
                             sliding_layers=None if sliding is None else sliding[:num_layers])


@dataclasses.dataclass(frozen=True)
class Cost:
  """FLOPs and HBM bytes accessed of a program on one chip."""

  flops: float
  bytes_accessed: float

  def __add__(self, other: Cost) -> Cost:
    return Cost(self.flops + other.flops, self.bytes_accessed + other.bytes_accessed)

  def __sub__(self, other: Cost) -> Cost:
    return Cost(self.flops - other.flops, self.bytes_accessed - other.bytes_accessed)

  def __mul__(self, k: float) -> Cost:
    return Cost(self.flops * k, self.bytes_accessed * k)


def xla_cost(compiled) -> Cost | None:
  """`compiled.cost_analysis()`'s "flops" and "bytes accessed" (loop bodies counted once); None
  where XLA has no cost analysis (its GPU compiler without a GPU)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list | tuple):
    analysis = analysis[0] if analysis else None
  if not analysis:
    return None
  return Cost(float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)))


@dataclasses.dataclass(frozen=True)
class Program:
  """A program ready to compile: `lower(*args)` (a `MeshJit` or a `jax.jit` under the mesh's
  layer gathering), its abstract arguments, and the per-chip bytes of the run's resident arrays
  it does not take (`outside_bytes`)."""

  lower: Callable
  args: tuple
  outside_bytes: int = 0


class DoesNotFit(PlanError):
  """XLA refused a program for want of HBM (RESOURCE_EXHAUSTED): it does not fit one chip.

  Attributes:
    required_bytes: what XLA said the program needs, when the message gives it; None otherwise.
    temporaries_only: whether that figure is the program's temporaries alone (TPU: "the total
      memory required for HLO temporaries"), without its arguments.
  """

  def __init__(self, message: str, required_bytes: int | None = None, *,
               temporaries_only: bool = False):
    super().__init__(message)
    self.required_bytes = required_bytes
    self.temporaries_only = temporaries_only


_SIZE = re.compile(r"required for [^(]*\(([\d.]+)([KMGT])\)")


_COMPILED: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
"""The last `_COMPILED_KEEP` programs compiled in this process, by topology, devices and
StableHLO text: a plan that re-plans what another plan compiled (the advice's search, the
memory and then the costs of a slice) compiles it once. JAX's persistent compilation cache
cannot serve these: it cannot load an executable compiled for devices that are not present."""
_COMPILED_KEEP = 16


def _program_key(lowered, program: Program, topology: str) -> tuple:
  meshes = {tuple(int(i) for i in leaf.sharding.mesh.device_ids.flat)
            for leaf in jax.tree.leaves(program.args)
            if isinstance(getattr(leaf, "sharding", None), NamedSharding)}
  text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
  return topology, tuple(sorted(meshes)), text


def compile_program(name: str, program: Program, *, topology: str):
  """`program` lowered and compiled (once per process for the same program on the same
  devices: `_COMPILED`); PlanError naming the program and the topology when XLA refuses it
  (`DoesNotFit` when for want of HBM)."""
  try:
    lowered = program.lower(*program.args)
    key = _program_key(lowered, program, topology)
    if key in _COMPILED:
      _COMPILED.move_to_end(key)
      return _COMPILED[key]
    compiled = lowered.compile()
  except Exception as e:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    kind = "GPU" if is_gpu_topology(topology) else "TPU"
    message = f"program {name!r} does not compile for {kind} topology {topology!r}: {first}"
    if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
      size = _SIZE.search(text)
      required = (None if size is None else
                  int(float(size.group(1)) * 2.0 ** (10 * "KMGT".index(size.group(2)) + 10)))
      raise DoesNotFit(message, required,
                       temporaries_only=size is not None and "temporaries" in size.group(0)) from e
    raise PlanError(message) from e
  _COMPILED[key] = compiled
  while len(_COMPILED) > _COMPILED_KEEP:
    _COMPILED.popitem(last=False)
  return compiled


# ---- the plan ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramPlan:
  """One compiled program on one chip (bytes from `memory_analysis()`, costs loop-corrected)."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  outside_bytes: int
  """Resident arrays the program does not take (e.g. the optimizer state while sampling)."""
  flops: float | None
  """Loop-corrected (every trip counted); None on GPUs (no cost analysis without one)."""
  bytes_accessed: float | None
  xla_flops: float | None
  """XLA's own count for the program as the run compiles it (each loop body counted once)."""
  xla_bytes_accessed: float | None
  roofline_s: float | None

  @property
  def peak_bytes_per_chip(self) -> int:
    """`arguments + outputs - aliased + temporaries + outside` (module docstring)."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.outside_bytes)

  @classmethod
  def read(cls, compiled, program: Program, cost: Cost | None, chip: Chip, *,
           dtype: str) -> ProgramPlan:
    """The plan of `program`, compiled as `compiled`, with its loop-corrected `cost` (None: no
    costs, as on GPUs)."""
    memory, xla = compiled.memory_analysis(), xla_cost(compiled)
    costs = dict(flops=None, bytes_accessed=None, xla_flops=None, xla_bytes_accessed=None,
                 roofline_s=None)
    if cost is not None and xla is not None:
      costs = dict(flops=cost.flops, bytes_accessed=cost.bytes_accessed, xla_flops=xla.flops,
                   xla_bytes_accessed=xla.bytes_accessed,
                   roofline_s=roofline_seconds(cost.flops, cost.bytes_accessed, chip,
                                               dtype=dtype))
    return cls(argument_bytes=int(memory.argument_size_in_bytes),
               output_bytes=int(memory.output_size_in_bytes),
               alias_bytes=int(memory.alias_size_in_bytes),
               temp_bytes=int(memory.temp_size_in_bytes), outside_bytes=program.outside_bytes,
               **costs)

  def to_json(self) -> dict[str, Any]:
    return {"peak_bytes_per_chip": self.peak_bytes_per_chip,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """A run's programs compiled for a TPU slice or GPU nodes: per-chip memory, costs and the
  fit."""

  topology: str
  chip: str
  chips: int
  hosts: int
  hbm_per_chip_bytes: int
  mesh: dict[str, int]
  dtype: str
  resident_bytes_per_chip: dict[str, int]
  programs: dict[str, ProgramPlan]
  advice: tuple[dict[str, Any], ...] = ()
  """When the run does not fit: the change that makes it fit, found by re-planning
  (`jax_ppo.diagnostics.advice.Advice.to_json`)."""
  costs_rows_divisor: int | None = None
  """`k` when the costs come from the run at `1/k` and `2/k` of its rows
  (`row_extrapolated_costs`: the cost variants were refused at its rows; FLOPs exact, bytes
  accessed approximate); None when they were compiled at its rows."""
  memory_fraction: float = 1.0
  """The share of the chip's HBM the run may use: 1 on a TPU, JAX's allocator's share on a GPU
  (`memory_fraction_of`)."""

  @property
  def usable_bytes_per_chip(self) -> int:
    """`memory_fraction` of the chip's HBM."""
    return int(self.hbm_per_chip_bytes * self.memory_fraction)

  @property
  def fits(self) -> bool:
    """Every program's peak is at most `usable_bytes_per_chip`."""
    return all(p.peak_bytes_per_chip <= self.usable_bytes_per_chip
               for p in self.programs.values())

  def to_json(self) -> dict[str, Any]:
    """`{"topology", "chip", "chips", "hosts", "hbm_per_chip_bytes", "memory_fraction",
    "usable_bytes_per_chip", "fits", "mesh", "dtype", "resident_bytes_per_chip", "advice":
    [{"change", "why", "peak_bytes_per_chip", "fits"}], "costs_rows_divisor", "programs": {name:
    {"peak_bytes_per_chip", "argument_bytes", "temp_bytes", "flops", "bytes_accessed",
    "roofline_s", ...}}}` (bytes and FLOPs per chip)."""
    return {"topology": self.topology, "chip": self.chip, "chips": self.chips,
            "hosts": self.hosts, "hbm_per_chip_bytes": self.hbm_per_chip_bytes,
            "memory_fraction": self.memory_fraction,
            "usable_bytes_per_chip": self.usable_bytes_per_chip, "fits": self.fits,
            "mesh": self.mesh, "dtype": self.dtype,
            "resident_bytes_per_chip": self.resident_bytes_per_chip,
            "advice": list(self.advice), "costs_rows_divisor": self.costs_rows_divisor,
            "programs": {name: p.to_json() for name, p in self.programs.items()}}


def peak_bytes(memory, outside_bytes: int = 0) -> int:
  """A program's peak per chip from its `compiled.memory_analysis()`: arguments + outputs -
  aliased + temporaries + the resident arrays it does not take (module docstring)."""
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes + outside_bytes)


def depth_costs(programs_at: Callable[[int], Mapping[str, Program]], depth: int, *,
                topology: str) -> dict[str, Cost]:
  """XLA costs of a stage's programs at depth `depth`, extrapolated from `programs_at(1)` and
  `programs_at(2)` (the programs built with that many unrolled layers):
  `C(L) = C(1) + (L - 1) (C(2) - C(1))`."""
  return grouped_depth_costs(lambda layers: programs_at(layers["model"]), {"model": depth},
                             topology=topology)


def grouped_depth_costs(programs_at: Callable[[dict[str, int]], Mapping[str, Program]],
                        depths: Mapping[str, int], *, topology: str) -> dict[str, Cost]:
  """XLA costs of programs over several models of depths `depths` (by model name), extrapolated
  in each depth apart: the models are grouped by depth, every group `g` is compiled at 2
  layers with the others at 1, and

  .. math::  C = C_1 + \\sum_g (L_g - 1) (C_{g,2} - C_1)

  (`C_1`: every model at 1 layer). A program's cost is a sum over its models' layers, so this is
  exact for layers of equal shapes; models of one depth share a variant (one model, or a
  policy, reference and critic of one architecture: two compiles)."""
  groups: dict[int, list[str]] = {}
  for name, depth in depths.items():
    groups.setdefault(depth, []).append(name)

  def costs(layers: dict[str, int]) -> dict[str, Cost]:
    return {name: xla_cost(compile_program(name, prog, topology=topology))
            for name, prog in programs_at(layers).items()}

  base = costs(dict.fromkeys(depths, 1))
  out = dict(base)
  for depth, names in groups.items():
    if depth < 2:
      continue
    two = costs({n: 2 if n in names else 1 for n in depths})
    out = {name: out[name] + (two[name] - base[name]) * (depth - 1) for name in out}
  return out


ROW_DIVISORS = (2, 4, 8, 16)
"""The fractions `1 / k` of a run's rows that `row_extrapolated_costs` tries, largest first."""


def row_extrapolated_costs(costs_at: Callable[[Any], Mapping[str, Cost]],
                           shape_at: Callable[[int], Any]) -> tuple[dict[str, Cost], int]:
  """Costs of a run whose cost variants need more HBM than the chip has, from the same run at a
  fraction of its rows.

  The cost variants compile the layers unrolled and the LM head unchunked (a `lax.map`'s body
  would be counted once), so near the chip's HBM they may be refused where the run's own
  programs fit. Every program's cost is affine in the rows when the loop trips stay the same
  (the weights are read once per program, the activations, FLOPs and KV cache scale with the
  rows), so from the run at `1/k` and `2/k` of its rows, `C_k` and `C_{k/2}`,

  .. math::  C = C_k + (k - 1) (C_{k/2} - C_k)

  for the first `k` of `ROW_DIVISORS` (from 4) at which both variants compile. The FLOPs are
  exact. XLA's bytes accessed are not: its fusions and layouts change with the shapes. On a
  tiny 4-layer run (`tests/diagnostics/test_plan.py`: 64 rows from 32 and 16) the sampler's
  and its decode steps' bytes came within 5%, the experience program's 13% and the split
  update's 2.04x over the bytes compiled at 64 rows. A roofline time bound by the FLOPs stays
  exact; one bound by the bytes (XLA's TPU count binds even the training programs of Qwen3-0.6B
  on v5e) carries their approximation.

  Args:
    costs_at: a run shape -> its programs' costs (raising `DoesNotFit` when XLA refuses one).
    shape_at: `k` -> the run with `1/k` of its rows and the same loop trips, or None where the
      rows do not divide so (groups, microbatches, the chips that share the rows).

  Returns:
    The costs at the run's rows, and `k`.

  Raises:
    DoesNotFit: no pair of fractions compiles (the last refusal).
  """
  larger, refusal = None, None
  for k in ROW_DIVISORS:
    shape = shape_at(k)
    if shape is None:
      break
    try:
      costs = costs_at(shape)
    except DoesNotFit as e:
      larger, refusal = None, e
      continue
    if larger is not None:
      return {name: costs[name] + (larger[name] - costs[name]) * (k - 1) for name in costs}, k
    larger = costs
  raise refusal or DoesNotFit(
      "the cost variants do not compile at fewer rows either: the rows do not divide further",
      None)


def require_compiler(topology: str) -> None:
  """PlanError naming the extra that compiles for `topology` (libtpu for a TPU slice, JAX's CUDA
  plugin for GPUs) unless it is installed; nothing is loaded."""
  if is_gpu_topology(topology):
    require_cuda_plugin()
  else:
    require_libtpu()


def topology_devices(topology: str) -> list:
  """The devices of `topology`: GPU nodes ("h100:8", "h200:2x8";
  `jax_ppo.diagnostics.gpu_topology`) or a TPU slice ("v5e:2x4"; `topology.tpu_devices`)."""
  return gpu_devices(topology) if is_gpu_topology(topology) else tpu_devices(topology)


def memory_fraction_of(topology: str) -> float:
  """The share of a chip's HBM a run on `topology` may use: JAX's GPU allocator's
  (`gpu_topology.allocator_fraction`, from this process's environment) for GPUs, 1 for TPUs."""
  return allocator_fraction() if is_gpu_topology(topology) else 1.0


def fraction_advice(plan: Plan, advised: Callable[[int], list[Advice]]) -> list[Advice]:
  """The advice for a run that does not fit (`plan`): the config changes `advised(usable)` finds
  against `usable` bytes per chip, at the plan's share of HBM; for a GPU plan under
  `RAISED_MEM_FRACTION`, raising JAX's allocator's share to it first: alone when the programs
  fit that share (no re-planning: the programs do not change), else in front of the changes
  found against it."""
  raised = int(plan.hbm_per_chip_bytes * RAISED_MEM_FRACTION)
  if not is_gpu_topology(plan.topology) or plan.memory_fraction >= RAISED_MEM_FRACTION:
    return advised(plan.usable_bytes_per_chip)
  variable = f"{MEM_FRACTION_VARS[0]}={RAISED_MEM_FRACTION}"
  share = (f"JAX's GPU allocator takes {plan.memory_fraction:.0%} of each GPU"
           + (" by default" if plan.memory_fraction == DEFAULT_MEM_FRACTION else "")
           + f"; {variable} is an environment variable of the run, not a config key")
  peak = max(p.peak_bytes_per_chip for p in plan.programs.values())
  if peak <= raised:
    return [Advice((variable,), share, peak, True)]
  return [dataclasses.replace(a, change=(variable, *a.change), why=f"{a.why}; {share}")
          for a in advised(raised)]


def plan_chip(devices: list, topology: str) -> Chip:
  """The datasheet row of the slice's chips; PlanError when the table does not list them."""
  kind = devices[0].device_kind
  chip = chip_for(kind)
  if chip is None:
    raise PlanError(f"topology {topology!r} has chips of kind {kind!r}, which the datasheet "
                    "table (jax_ppo.parallel.chips.CHIPS) does not list.")
  return chip


def program_peaks(programs: Mapping[str, Program], *, topology: str) -> dict[str, int]:
  """Per-chip peak bytes of each program (compiled for `topology`; `peak_bytes`), without costs.

  A program XLA refuses for want of HBM gets a lower bound on its peak (more than the chip has):
  what XLA said it needs, plus its arguments when that figure is its temporaries alone, plus the
  resident arrays it does not take (`refused_peak`); `sys.maxsize` when XLA gave no figure.
  """
  peaks = {}
  for name, program in programs.items():
    try:
      compiled = compile_program(name, program, topology=topology)
    except DoesNotFit as e:
      peaks[name] = refused_peak(e, program)
      continue
    peaks[name] = peak_bytes(compiled.memory_analysis(), program.outside_bytes)
  return peaks


def refused_peak(error: DoesNotFit, program: Program) -> int:
  """A lower bound on the per-chip peak of `program`, which XLA refused with `error`:
  `required + outside`, plus the arguments' per-chip bytes when `required` counts the
  temporaries alone (the outputs the program would not alias are not known without a compile);
  `sys.maxsize` when XLA's message gave no figure.

  XLA's figure is the temporaries of the schedule it gave up on, after its memory-saving passes
  tried to fit the chip, not the program's peak with HBM to spare: two slices' refusals do not
  compare (docs/accelerators.md, the planning table).
  """
  if error.required_bytes is None:
    return sys.maxsize
  arguments = shard_bytes(program.args) if error.temporaries_only else 0
  return error.required_bytes + arguments + program.outside_bytes


def shape_peaks(programs_of: Callable[[Any, Mesh], Any], shape: Any, topology: str, *,
                devices: list) -> dict[str, int]:
  """Per-chip peak bytes of each program of the run `shape` on the slice, compiled as the run
  compiles them, without costs (`program_peaks`). `programs_of(shape, mesh)` builds the run's
  programs over the slice's mesh (`ppo_plan.RunPrograms`, `stage_plan.StagePrograms`: an object
  with `programs()` and `resident_bytes`)."""
  mesh = slice_mesh(devices, shape.mesh, topology=topology)
  return program_peaks(programs_of(shape, mesh).programs(), topology=topology)


def plan_programs(programs_of: Callable[[Any, Mesh], Any], shape: Any, topology: str, *,
                  devices: list, costs: Callable[[Any, Mesh], Mapping[str, Cost]],
                  advice: bool) -> Plan:
  """The plan of the run `shape` on the slice: its programs (`programs_of(shape, mesh)`, as in
  `shape_peaks`) compiled and reported per chip (`compile_plan`), with `costs(programs, mesh)`,
  their loop-corrected costs, once every program has compiled (never on GPUs, where XLA has
  no cost analysis without a GPU: the plan's programs have no costs). With `advice`, when the
  run does not fit, the changes that make it fit (`jax_ppo.diagnostics.advice.advise`,
  re-planning each candidate's memory with `shape_peaks`) go into the plan, or into the
  `DoesNotFit` error when XLA refuses a program for want of HBM."""
  mesh = slice_mesh(devices, shape.mesh, topology=topology)
  run = programs_of(shape, mesh)

  def advised(usable: int) -> list[Advice]:
    return advise(shape, chips=len(devices), hbm_bytes=usable,
                  peaks_of=lambda s: shape_peaks(programs_of, s, topology, devices=devices))

  try:
    no_costs = is_gpu_topology(topology)
    plan = compile_plan(run.programs(), None if no_costs else (lambda: costs(run, mesh)),
                        topology=topology, devices=devices, mesh=mesh, dtype=shape.dtype,
                        resident_bytes=run.resident_bytes)
  except DoesNotFit as e:
    if not advice:
      raise
    found = advised(int(plan_chip(devices, topology).hbm_bytes * memory_fraction_of(topology)))
    fix = ("; it fits with " + " ".join(found[0].change) if found and found[0].fits else
           "; no change of mesh, accumulation, remat or LoRA makes it fit: plan a larger slice")
    raise DoesNotFit(str(e) + fix, e.required_bytes, temporaries_only=e.temporaries_only) from e
  if advice and not plan.fits:
    plan = dataclasses.replace(plan, advice=tuple(a.to_json()
                                                  for a in fraction_advice(plan, advised)))
  return plan


def compile_plan(programs: Mapping[str, Program],
                 costs: Mapping[str, Cost] | Callable[[], Mapping[str, Cost]] | None, *,
                 topology: str,
                 devices: list, mesh: Mesh, dtype: str,
                 resident_bytes: dict[str, int]) -> Plan:
  """Compiles `programs` (as the run compiles them) for `topology` and reports each per chip,
  with its loop-corrected `costs` and their roofline time on the slice's chip. `costs` may be a
  function, called once every program has compiled (a program that does not fit then fails
  before any cost variant is compiled), or None: no costs (GPUs)."""
  chip = plan_chip(devices, topology)
  fraction = memory_fraction_of(topology)  # a bad variable fails before any compile
  compiled = {name: compile_program(name, program, topology=topology)
              for name, program in programs.items()}
  costs = costs() if callable(costs) else costs
  costs = dict.fromkeys(programs) if costs is None else costs
  out = {name: ProgramPlan.read(compiled[name], program, costs[name], chip, dtype=dtype)
         for name, program in programs.items()}
  return Plan(topology=topology, chip=chip.name, chips=len(devices),
              hosts=len({d.process_index for d in devices}), hbm_per_chip_bytes=chip.hbm_bytes,
              mesh={a: int(mesh.shape[a]) for a in AXES}, dtype=dtype,
              resident_bytes_per_chip=resident_bytes,
              programs=out, memory_fraction=fraction)


def format_plan(plan: Plan) -> str:
  """The plan as a text table, one row per program (GiB per chip, GFLOP, seconds)."""
  gib = 2.0**30
  mesh = " ".join(f"{k}={v}" for k, v in plan.mesh.items())
  resident = ", ".join(f"{k} {v / gib:.3f}" for k, v in plan.resident_bytes_per_chip.items())
  lines = [
      f"{plan.topology}: {plan.chips} x {plan.chip} on {plan.hosts} host(s), mesh {mesh}, "
      f"{plan.dtype} compute, HBM {plan.hbm_per_chip_bytes / gib:.1f} GiB per chip"
      + ("" if plan.memory_fraction == 1.0 else
         f", {plan.usable_bytes_per_chip / gib:.1f} of it for JAX's allocator "
         f"({MEM_FRACTION_VARS[0]} {plan.memory_fraction})"),
      f"resident per chip (GiB): {resident}",
      f"{'program':<18}{'peak GiB':>10}{'args GiB':>10}{'temp GiB':>10}{'GFLOP':>12}"
      f"{'GB accessed':>13}{'roofline s':>12}",
  ]
  if plan.costs_rows_divisor is not None:
    k = plan.costs_rows_divisor
    lines.append(f"costs extrapolated from the run at 1/{k} and 2/{k} of its rows (its cost "
                 f"variants need more HBM than the chip has): FLOPs exact, GB accessed "
                 f"approximate")
  for name, p in plan.programs.items():
    costs = (f"{'-':>12}{'-':>13}{'-':>12}" if p.flops is None else
             f"{p.flops / 1e9:>12.3f}{p.bytes_accessed / 1e9:>13.3f}{p.roofline_s:>12.3g}")
    lines.append(f"{name:<18}{p.peak_bytes_per_chip / gib:>10.3f}{p.argument_bytes / gib:>10.3f}"
                 f"{p.temp_bytes / gib:>10.3f}{costs}")
  lines.append(f"fits: {'yes' if plan.fits else 'NO'} (largest peak "
               f"{max(p.peak_bytes_per_chip for p in plan.programs.values()) / gib:.3f} GiB of "
               f"{plan.usable_bytes_per_chip / gib:.1f})")
  for a in plan.advice:
    verdict = "fits" if a["fits"] else "still does not fit"
    lines.append(f"advice: {' '.join(a['change'])} ({a['why']}): largest peak "
                 f"{a['peak_bytes_per_chip'] / gib:.3f} GiB, {verdict}")
  return "\n".join(lines)


__all__ = [
    "Cost",
    "DoesNotFit",
    "Plan",
    "Program",
    "ProgramPlan",
    "compile_plan",
    "compile_program",
    "depth_costs",
    "grouped_depth_costs",
    "format_plan",
    "fraction_advice",
    "memory_fraction_of",
    "peak_bytes",
    "plan_chip",
    "plan_programs",
    "program_peaks",
    "refused_peak",
    "require_compiler",
    "ROW_DIVISORS",
    "row_extrapolated_costs",
    "shape_peaks",
    "topology_devices",
    "with_layers",
    "xla_cost",
]
