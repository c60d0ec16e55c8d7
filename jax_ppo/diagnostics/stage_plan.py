r"""The programs of an SFT or reward-model run compiled ahead of time for a TPU slice, from a CPU
host.

`plan_stage(shape, "v5e:2x4")` takes the slice's devices from libtpu
(`jax_ppo.diagnostics.topology`), lays the run's mesh `(data, fsdp, tensor)` over them, builds
the model from its config.json alone (`jax_ppo.models.load_config`: a `CausalLM` for SFT, a
`ScalarModel` for the reward model, LoRA adapters when the run has them), the AdamW state and a
batch as abstract `jax.ShapeDtypeStruct`s with their shardings (no weights, nothing allocated),
and compiles the stage's own programs with the stage's own shardings (the `MeshJit`s of
`jax_ppo.sft.steps.SFTSteps` and `jax_ppo.reward_model.steps.RewardModelSteps`, over the split
of `split_trainable`, exactly what the trainers run):

* `train_step`: one optimizer step, the `A = gradient_accumulation_steps` microbatch gradients
  of a `lax.scan` and the guarded AdamW update; SFT on `B = sft.batch_size` rows of
  `L = sft.max_length` tokens, the reward model on `N = reward.batch_size` pairs (`2N` rows, the
  chosen and the rejected, of `reward.max_length` tokens: the longest a batch can be);
* `eval_step`: the held-out sums (SFT on `B` rows, the reward model on `reward.eval_batch_size`
  pairs), while the optimizer state stays on the chip.

Memory, fit and roofline as in `jax_ppo.diagnostics.plan`; the resident arrays per chip are the
trainable parameters, the optimizer state and the frozen rest (LoRA's base weights). A run that
does not fit gets the smallest change that makes it fit (`jax_ppo.diagnostics.advice`: FSDP over
more chips, more gradient accumulation, LoRA), as `jax-ppo sft` / `reward` overrides. Costs: the
layers come from variants compiled with 1 and 2 unrolled layers (`plan.depth_costs`), and the
accumulation scan, whose body XLA counts once, is counted back from one microbatch's
`value_and_grad` compiled alone (`microbatch_grad`):

    train_step = XLA + (A - 1) microbatch_grad

SFT's LM head works `L`-chunk by `L`-chunk above `SFTSteps.logits_chunk_bytes` of logits (a
`lax.map`); the cost variants compute the logits unchunked (the same projection FLOPs; the
chunks' `jax.checkpoint` recomputation in the backward pass is not counted), the programs whose
memory is reported are chunked as the run's are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.diagnostics.advice import Knobs
from jax_ppo.diagnostics.memory import placed_abstract, shard_bytes
from jax_ppo.diagnostics.plan import (
  Cost,
  Plan,
  Program,
  depth_costs,
  plan_programs,
  shape_peaks,
  topology_devices,
  with_layers,
)
from jax_ppo.diagnostics.shapes import SHAPE_PREFIX, plan_model_config
from jax_ppo.models import (
  DEFAULT_REMAT,
  CausalLM,
  LoRAConfig,
  ModelConfig,
  ScalarModel,
  add_lora,
)
from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.mesh import MeshConfig
from jax_ppo.reward_model.config import RewardModelConfig
from jax_ppo.reward_model.pairwise import PreferencePairs
from jax_ppo.reward_model.steps import RewardModelSteps
from jax_ppo.reward_model.steps import split_trainable as reward_split
from jax_ppo.runs.common import DTYPES, check_model_folder, resolve_model_paths
from jax_ppo.runs.reward import RewardRunConfig
from jax_ppo.runs.sft import SFTRunConfig
from jax_ppo.sft.config import SFTConfig
from jax_ppo.sft.steps import SFTBatch, SFTSteps
from jax_ppo.sft.steps import split_trainable as sft_split
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.state import init_stage_state

# ---- what is planned -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageShape:
  """The shapes of an SFT or reward-model run, all a plan needs (no weights)."""

  model: ModelConfig
  """The architecture (config.json only: `jax_ppo.diagnostics.shapes.plan_model_config`)."""
  config: SFTConfig | RewardModelConfig
  """The stage's hyperparameters (batch geometry, accumulation, length, layer loop); its type
  says the stage."""
  dtype: str = "float32"
  """Compute dtype name (`jax_ppo.runs.common.DTYPES`); parameters and moments stay float32."""
  remat: str = DEFAULT_REMAT
  """Rematerialisation of each layer in the backward pass (the stages load with the default)."""
  lora: LoRAConfig | None = None
  """LoRA adapters instead of a full fine-tune."""
  mesh: MeshConfig | None = None
  """Mesh sizes over the slice's chips; None: data parallel over all of them."""

  def __post_init__(self):
    if not isinstance(self.config, SFTConfig | RewardModelConfig):
      raise ValueError(f"StageShape.config must be an SFTConfig or a RewardModelConfig, got "
                       f"{type(self.config).__name__}.")
    if self.dtype not in DTYPES:
      raise ValueError(f"StageShape.dtype={self.dtype!r}: choose one of {list(DTYPES)}.")

  @property
  def stage(self) -> str:
    """"sft" or "reward"."""
    return "sft" if isinstance(self.config, SFTConfig) else "reward"

  @property
  def knobs(self) -> Knobs:
    """What `jax_ppo.diagnostics.advice.advise` may change: the batch's accumulation (`sft.` or
    `reward.`; the reward model's batch is pairs); no remat (the stage runs have no such field)."""
    return Knobs(section=self.stage, field="config", rows=self.config.batch_size, remat=False)


def stage_shape(config: SFTRunConfig | RewardRunConfig) -> StageShape:
  """The `StageShape` of a `jax-ppo sft` or `jax-ppo reward` config: the model's architecture
  from its config.json alone (`jax_ppo.diagnostics.shapes.plan_model_config`: a folder, no
  weights, or `shape:NAME` for a common model; no tokenizer either, so a pad token that
  `resize_embeddings` would add is not counted)."""
  if isinstance(config, SFTRunConfig):
    stage, field = config.sft, "SFTRunConfig.model_path"
  elif isinstance(config, RewardRunConfig):
    stage, field = config.reward, "RewardRunConfig.model_path"
  else:
    raise ValueError(f"stage_shape takes an SFTRunConfig or a RewardRunConfig, got "
                     f"{type(config).__name__}.")
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  if not config.model_path.startswith(SHAPE_PREFIX):
    check_model_folder(field, config.model_path)
  return StageShape(model=plan_model_config(config.model_path), config=stage, dtype=config.dtype,
                    lora=config.lora, mesh=config.mesh)


def loop_corrected(xla: dict[str, Cost], *, accumulation_steps: int) -> dict[str, Cost]:
  """The programs' costs with every microbatch counted (module docstring), from the XLA costs
  `xla` of the programs and of `microbatch_grad` (needed when `accumulation_steps > 1`)."""
  out = {name: cost for name, cost in xla.items() if name != "microbatch_grad"}
  if accumulation_steps > 1:
    out["train_step"] = xla["train_step"] + xla["microbatch_grad"] * (accumulation_steps - 1)
  return out


# ---- the programs --------------------------------------------------------------------------


class StagePrograms:
  """The abstract state and the programs of one SFT or reward-model run on `mesh`.

  Args:
    shape: the run.
    mesh: the device mesh (over a TPU slice's devices, or any other).
    num_layers: build the model with this many layers (None: the model's own).
    scan_layers: the layer loop (None: the stage's `train_scan_layers`, else the model's scan).
    chunk_logits: SFT's LM head chunked as the run's (False: unchunked, for the costs).
  """

  def __init__(self, shape: StageShape, mesh: Mesh, *, num_layers: int | None = None,
               scan_layers: bool | None = None, chunk_logits: bool = True):
    c = self.config = shape.config
    self.shape, self.mesh = shape, mesh
    model_config = shape.model if num_layers is None else with_layers(shape.model, num_layers)
    dtype, sft = DTYPES[shape.dtype], shape.stage == "sft"

    def build():
      kind = CausalLM if sft else ScalarModel
      model = kind(model_config, dtype=dtype, param_dtype=jnp.float32, remat=shape.remat,
                   rngs=nnx.Rngs(0))
      if shape.lora is not None:
        add_lora(model, shape.lora, rngs=nnx.Rngs(0))
      return model

    model = nnx.eval_shape(build)
    scan = c.train_scan_layers if scan_layers is None else scan_layers
    graphdef, params, rest = (sft_split if sft else reward_split)(model, scan_layers=scan)
    optimizer, schedule = make_optimizer(c.optimizer, c.total_steps or 1)
    if sft:
      self.steps = SFTSteps(c, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                            mesh=mesh)
      if not chunk_logits:
        self.steps.logits_chunk_bytes = None
    else:
      self.steps = RewardModelSteps(graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                                    accumulation_steps=c.gradient_accumulation_steps, mesh=mesh)
    self.state = placed_abstract(jax.eval_shape(lambda p: init_stage_state(optimizer, p), params),
                                 "params", mesh)
    self.rest = placed_abstract(rest, "params", mesh)

  @property
  def resident_bytes(self) -> dict[str, int]:
    """Per-chip bytes of the arrays a run holds between steps: trainable parameters, the
    optimizer state (with the step counter and learning-rate scale) and the frozen rest
    (LoRA's base weights)."""
    return {"params": shard_bytes(self.state.params),
            "optimizer": shard_bytes((self.state.opt_state, self.state.step,
                                      self.state.lr_scale)),
            "frozen": shard_bytes(self.rest)}

  def _rows(self, *shape, dtype=jnp.int32):
    return placed_abstract(jax.ShapeDtypeStruct(shape, dtype), "batch", self.mesh)

  def batch(self, rows: int) -> SFTBatch | PreferencePairs:
    """An abstract batch of `rows` rows (SFT) or pairs (reward model), placed on rows."""
    c = self.config
    if self.shape.stage == "sft":
      ids = lambda dt=jnp.int32: self._rows(rows, c.max_length, dtype=dt)  # noqa: E731
      return SFTBatch(input_ids=ids(), attention_mask=ids(jnp.bool_), positions=ids(),
                      segment_ids=ids() if c.packing else None, targets=ids(),
                      loss_mask=ids(jnp.bool_))
    ids = lambda: self._rows(rows, c.max_length)  # noqa: E731
    return PreferencePairs(chosen_ids=ids(), chosen_mask=ids(), rejected_ids=ids(),
                           rejected_mask=ids(), margin=self._rows(rows, dtype=jnp.float32))

  def programs(self, *, pieces: bool = False) -> dict[str, Program]:
    """The run's programs by name, `train_step` and `eval_step` (with `pieces` and gradient
    accumulation, also `microbatch_grad`, the scan's body that `loop_corrected` scales)."""
    c, steps, state, rest = self.config, self.steps, self.state, self.rest
    optimizer = self.resident_bytes["optimizer"]
    out = {"train_step": Program(steps.train_step.lower, (state, rest, self.batch(c.batch_size)))}
    if self.shape.stage == "sft":
      out["eval_step"] = Program(steps.eval_sums.lower,
                                 (state.params, rest, self.batch(c.batch_size)), optimizer)
    else:
      n = c.eval_batch_size
      out["eval_step"] = Program(
          steps.eval_sums.lower,
          (state.params, rest, self.batch(n), self._rows(n, dtype=jnp.float32)), optimizer)
    if pieces and c.gradient_accumulation_steps > 1:
      out["microbatch_grad"] = self._microbatch_grad()
    return out

  def _mesh_jit(self, fn: Callable, in_roles: tuple[str, ...]) -> Callable:
    return MeshJit(fn, self.mesh, in_roles=in_roles, out_roles=("replicated", "params"),
                   keep_unused=True).lower

  def _microbatch_grad(self) -> Program:
    c, steps, params, rest = self.config, self.steps, self.state.params, self.rest
    micro = self.batch(c.batch_size // c.gradient_accumulation_steps)
    scalar = placed_abstract(jax.ShapeDtypeStruct((), jnp.float32), "replicated", self.mesh)
    if self.shape.stage == "sft":
      def sft_grad(params, rest, mb, num_tokens):
        return jax.value_and_grad(steps.micro_loss)(params, rest, mb, num_tokens)

      return Program(self._mesh_jit(sft_grad, ("params", "params", "batch", "replicated")),
                     (params, rest, micro, scalar))

    def reward_grad(params, rest, mb, weight, total):
      return jax.value_and_grad(steps.loss, has_aux=True)(params, rest, mb, weight, total)

    weight = self._rows(micro.margin.shape[0], dtype=jnp.float32)
    return Program(self._mesh_jit(reward_grad, ("params", "params", "batch", "batch",
                                                "replicated")),
                   (params, rest, micro, weight, scalar))


def layer_costs(shape: StageShape, mesh: Mesh, *, topology: str) -> dict[str, Cost]:
  """XLA costs of the programs and `microbatch_grad` at the model's full depth, extrapolated
  from variants compiled with 1 and 2 unrolled layers (`jax_ppo.diagnostics.plan.depth_costs`),
  the LM head unchunked."""
  return depth_costs(lambda layers: StagePrograms(shape, mesh, num_layers=layers,
                                                  scan_layers=False, chunk_logits=False
                                                  ).programs(pieces=True),
                     shape.model.num_layers, topology=topology)


def memory_peaks(shape: StageShape, topology: str, *, devices: list) -> dict[str, int]:
  """Per-chip peak bytes of each program of `shape` on the slice, compiled as the run compiles
  them, without costs (`jax_ppo.diagnostics.plan.shape_peaks`)."""
  return shape_peaks(StagePrograms, shape, topology, devices=devices)


def plan_stage(shape: StageShape, topology: str, *, devices: list | None = None,
               advice: bool = True) -> Plan:
  """Compiles the programs of `shape` for the TPU slice or GPU nodes `topology` and reports them
  per chip.

  Args:
    shape: the run (model shapes, stage hyperparameters, dtype, LoRA, mesh sizes).
    topology: a TPU slice name libtpu knows, e.g. "v5e:2x4", "v5p:2x2x4", or GPU nodes,
      e.g. "h100:8", "h200:2x8" (`jax_ppo.diagnostics.gpu_topology`; memory only, no costs).
    devices: the slice's devices (default: `topology_devices(topology)`).
    advice: when the run does not fit, search the change that makes it fit
      (`jax_ppo.diagnostics.advice.advise`: FSDP, gradient accumulation, LoRA; re-planning the
      memory of each candidate).

  Raises:
    PlanError: libtpu (or the CUDA plugin) missing, libtpu in use, an unknown topology or
      chip, a mesh that does not fit, a program that does not compile (naming it and the
      topology).
  """
  devices = topology_devices(topology) if devices is None else devices

  def costs(run: StagePrograms, mesh: Mesh) -> dict[str, Cost]:
    return loop_corrected(layer_costs(shape, mesh, topology=topology),
                          accumulation_steps=shape.config.gradient_accumulation_steps)

  return plan_programs(StagePrograms, shape, topology, devices=devices, costs=costs,
                       advice=advice)


__all__ = [
    "StagePrograms",
    "StageShape",
    "layer_costs",
    "loop_corrected",
    "memory_peaks",
    "plan_stage",
    "stage_shape",
]
