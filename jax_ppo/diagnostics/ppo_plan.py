"""The programs of a PPO run compiled ahead of time for a TPU slice, from a CPU host.

`plan_run(shape, "v5e:2x4")` takes the slice's devices from libtpu
(`jax_ppo.diagnostics.topology`), lays the run's mesh `(data, fsdp, tensor)` over them, builds
the policy, its reference, the AdamW state and the rollout as abstract `jax.ShapeDtypeStruct`s
with their shardings (no weights, nothing allocated) and compiles, with the run's own shardings
(`jax_ppo.ppo.programs.PROGRAM_ROLES`), with every model of the run: the policy (a value head on
its trunk, or a separate critic), its reference (a LoRA policy's base weights), the reward
models:

* `generate`: the sampler's prefill and `lax.while_loop` decode (`jax_ppo.rollout.sampler`);
* `score` (`score_0`, `score_1`, ... with several): each reward model scoring the rollout;
* `experience` then `update` (epochs x minibatches x microbatches), or `experience_update`, the
  fused program of a run whose first epoch is one optimizer step on the whole batch;
* `replay_update` when the run replays batches.

Memory, fit and roofline as in `jax_ppo.diagnostics.plan`. The loops other than the layers are
counted back from their bodies compiled alone (`decode_step_k`: the step of the sampler's k-th
decode loop, `jax_ppo.rollout.sampler.decode_body` as that loop runs it, attending over its
segment's cache prefix, its weights in the compute dtype and its cache in the loop's layout,
unrolled at full depth (`layer_costs`); `microbatch_grad`: one microbatch's `value_and_grad`;
`optimizer_step`: one guarded AdamW step), with `T = sampling.max_new_tokens`, `n_k` the steps of
decode loop `k` (`jax_ppo.rollout.sampler.segment_schedule`: `sum n_k = T - 1`),
`E = ppo_epochs`, `M = num_minibatches`, `A = gradient_accumulation_steps`:

    generate          = XLA + sum_k (n_k - 1) decode_step_k   (prefill, then T - 1 decode steps)
    update            = XLA + (E M A - 1) microbatch_grad + (E M - 1) optimizer_step
    experience_update = XLA + (E - 2) (microbatch_grad + optimizer_step)        (E >= 2)

The decode loop is counted at its bound (no row stops early), an upper bound of the sampler's
work. Near the chip's HBM the cost variants (unrolled layers, unchunked LM head) may be refused
where the run's programs fit; their costs then come from the run at a fraction of its rows
(`rows_divided`), extrapolated in the rows (`jax_ppo.diagnostics.plan.row_extrapolated_costs`),
and a plan whose variants compile at no fraction has no costs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh

from jax_ppo.diagnostics.advice import Knobs
from jax_ppo.diagnostics.memory import placed_abstract, shard_bytes
from jax_ppo.diagnostics.plan import (
  Cost,
  DoesNotFit,
  Plan,
  Program,
  compile_program,
  grouped_depth_costs,
  plan_programs,
  row_extrapolated_costs,
  shape_peaks,
  topology_devices,
  with_layers,
  xla_cost,
)
from jax_ppo.diagnostics.shapes import plan_model_config
from jax_ppo.diagnostics.topology import PlanError
from jax_ppo.models import (
  DEFAULT_REMAT,
  CausalLM,
  LoRAConfig,
  ModelConfig,
  ScalarModel,
  add_lora,
  compute_weights,
  layer_loop,
)
from jax_ppo.models import init_cache as new_cache
from jax_ppo.parallel import rules
from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.mesh import MeshConfig, batch_axis_size
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.ppo.loss import coefficients
from jax_ppo.ppo.programs import PROGRAM_ROLES
from jax_ppo.ppo.state import FrozenParams, init_train_state
from jax_ppo.ppo.steps import PPOSteps
from jax_ppo.rollout.batching import bucket_for
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.layout import decode_state_jit, sampler_mesh
from jax_ppo.rollout.sampler import (
  DecodeCarry,
  DecodeSegment,
  Rollout,
  decode_body,
  generate,
  segment_schedule,
)
from jax_ppo.runs.common import DTYPES, resolve_model_paths
from jax_ppo.runs.ppo_config import RunConfig
from jax_ppo.training.optim import make_optimizer

logger = logging.getLogger(__name__)

# ---- what is planned -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunShape:
  """The shapes of a PPO run, all a plan needs (no weights)."""

  model: ModelConfig
  """The policy's architecture (config.json only: `jax_ppo.diagnostics.shapes.plan_model_config`,
  a folder or a common model's name `shape:NAME`)."""
  ppo: PPOConfig
  """The run's PPO hyperparameters (batch geometry, epochs, sampling, layer loops)."""
  prompt_length: int = 512
  """`S`, the (bucketed) prompt slots of every row."""
  dtype: str = "float32"
  """Compute dtype name (`jax_ppo.runs.common.DTYPES`); parameters and moments stay float32."""
  remat: str = DEFAULT_REMAT
  """Rematerialisation of each layer in the training backward pass."""
  lora: LoRAConfig | None = None
  """LoRA adapters instead of a full fine-tune."""
  mesh: MeshConfig | None = None
  """Mesh sizes over the slice's chips; None: data parallel over all of them."""
  reward_models: tuple[ModelConfig, ...] = ()
  """The architectures of the run's reward models (each scores the rollout in a `score`
  program); empty when the rewards are functions."""
  critic: ModelConfig | None = None
  """A separate critic's architecture (a `ScalarModel` trained beside the policy); None: no critic,
  or a value head on the policy trunk (`ppo.uses_critic`)."""

  def __post_init__(self):
    if not isinstance(self.prompt_length, int) or self.prompt_length < 1:
      raise ValueError(f"RunShape.prompt_length={self.prompt_length!r}: use an int >= 1.")
    if self.dtype not in DTYPES:
      raise ValueError(f"RunShape.dtype={self.dtype!r}: choose one of {list(DTYPES)}.")

  @property
  def knobs(self) -> Knobs:
    """What `jax_ppo.diagnostics.advice.advise` may change: the minibatch's accumulation
    (`ppo.`) and `remat`."""
    return Knobs(section="ppo", field="ppo", rows=self.ppo.minibatch_size, remat=True)


def run_shape(config: RunConfig, *, prompt_length: int) -> RunShape:
  """The `RunShape` of a `jax-ppo train` config: every model's architecture from its config.json
  alone (`jax_ppo.diagnostics.shapes.plan_model_config`: a folder, no weights, or `shape:NAME`
  for a common model), `prompt_length` rounded up to the sampler's
  prompt bucket (as a run pads its prompts).

  The critic is what `jax_ppo.runs.ppo.build_trainer` makes it: the `value_model_path` model; else,
  with a reward model and `advantage_mode="gae"`, a copy of the first reward model when its
  vocabulary is the policy's (the run compares the two tokenizers; the plan their config.json
  vocabulary sizes); else a value head on the policy trunk.

  Raises:
    PlanError: roles on sub-meshes of their own (`placement`), which the plan does not lay out.
  """
  if config.placement.split_roles:
    raise PlanError(
        "jax-ppo plan lays every role on the run's one mesh: roles on sub-meshes of their own "
        "(placement.reference / reward / critic / policy_devices) are not planned; plan the run "
        "without placement (every role sharing RunConfig.mesh) for its programs' sizes.")
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  policy = plan_model_config(config.policy_path)
  paths = [config.reward_model_path, *(r.model_path for r in config.rewards)]
  rewards = tuple(plan_model_config(p) for p in paths if p is not None)
  critic = None
  if config.ppo.uses_critic:
    if config.value_model_path is not None:
      critic = plan_model_config(config.value_model_path)
    elif rewards and rewards[0].vocab_size == policy.vocab_size:
      critic = rewards[0]
  buckets = SamplingConfig().prompt_buckets
  return RunShape(model=policy, ppo=config.ppo,
                  prompt_length=bucket_for(prompt_length, buckets, what="--prompt-length"),
                  dtype=config.dtype, remat=config.remat, lora=config.lora, mesh=config.mesh,
                  reward_models=rewards, critic=critic)


def sampling_config(ppo: PPOConfig) -> SamplingConfig:
  """The sampler's configuration of a run, as `PPOTrainer` builds it (the one place the plan
  reads the sampling fields of `PPOConfig`)."""
  return SamplingConfig.from_params(ppo.sampling, n_samples=ppo.n_samples,
                                    batch_buckets=(ppo.prompts_per_update,))


def decode_segments(ppo: PPOConfig, *, prompt_length: int, max_new_tokens: int | None = None
                    ) -> tuple[DecodeSegment, ...]:
  """The sampler's decode loops of a run (`segment_schedule` at the run's
  `SamplingConfig.decode_segments`); `max_new_tokens` defaults to the run's."""
  sampling = sampling_config(ppo)
  t = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
  return segment_schedule(prompt_length, t, sampling.decode_segments)


def decode_piece(k: int) -> str:
  """The name of the step of the sampler's `k`-th decode loop among a run's pieces."""
  return f"decode_step_{k}"


def is_piece(name: str) -> bool:
  """A loop body compiled alone (`PIECES`, a decode loop's `decode_piece`), not a program."""
  return name in PIECES or name.startswith("decode_step_")


def loop_trips(ppo: PPOConfig, programs: Iterable[str], *, max_new_tokens: int
               ) -> dict[str, dict[str, int]]:
  """The trips each loop body adds to each program beyond XLA's one (module docstring):
  `{program: {piece: trips}}`, pieces with no trips left out (a decode loop of one step)."""
  e, m, a = ppo.ppo_epochs, ppo.num_minibatches, ppo.gradient_accumulation_steps
  trips = {}
  for name in programs:
    if name == "generate":  # the steps of each loop do not depend on the prompt length
      segments = decode_segments(ppo, prompt_length=0, max_new_tokens=max_new_tokens)
      trips[name] = {decode_piece(k): seg.steps - 1 for k, seg in enumerate(segments)}
    elif name in ("update", "replay_update"):
      trips[name] = {"microbatch_grad": e * m * a - 1, "optimizer_step": e * m - 1}
    elif name == "experience_update":
      trips[name] = {"microbatch_grad": max(e - 2, 0), "optimizer_step": max(e - 2, 0)}
    else:
      trips[name] = {}
  return {name: {p: n for p, n in t.items() if n > 0} for name, t in trips.items()}


def loop_corrected(xla: dict[str, Cost], ppo: PPOConfig, *, max_new_tokens: int
                   ) -> dict[str, Cost]:
  """The programs' costs with every loop trip counted (module docstring), from the XLA costs
  `xla` of the programs and of the loop bodies compiled alone (`decode_step_k`,
  `microbatch_grad`, `optimizer_step`: those with trips, `loop_trips`), all with unrolled
  layers."""
  programs = [n for n in xla if not is_piece(n)]
  out = {}
  for name, trips in loop_trips(ppo, programs, max_new_tokens=max_new_tokens).items():
    cost = xla[name]
    for piece, n in trips.items():
      cost = cost + xla[piece] * n
    out[name] = cost
  return out


# ---- the programs --------------------------------------------------------------------------


PIECES = ("decode_step", "microbatch_grad", "optimizer_step")
"""The loop bodies compiled alone to count their trips back (`RunPrograms.programs(pieces=...)`);
"decode_step" names the steps of all the sampler's decode loops (`decode_piece(k)`)."""


def model_depths(shape: RunShape) -> dict[str, int]:
  """The depth of each model of the run by role ("policy", "critic", "reward_0", ...): the
  layer counts `grouped_depth_costs` extrapolates in."""
  depths = {"policy": shape.model.num_layers}
  if shape.critic is not None:
    depths["critic"] = shape.critic.num_layers
  depths.update({f"reward_{i}": m.num_layers for i, m in enumerate(shape.reward_models)})
  return depths


class RunPrograms:
  """The abstract state and the programs of one PPO run on `mesh`.

  Args:
    shape: the run.
    mesh: the device mesh (over a TPU slice's devices, or any other).
    layers: build each model (by `model_depths` role) with this many layers (None, or a role
      left out: the model's own).
    scan_layers: the layer loop of every program (None: the run's `train_scan_layers` /
      `rollout_scan_layers`, else the model's scan).
    only: the names of the programs `programs` returns (None: all the run's), e.g.
      `("generate",)` to plan the rollout alone; loop bodies asked for are always returned.
  """

  def __init__(self, shape: RunShape, mesh: Mesh, *, layers: dict[str, int] | None = None,
               scan_layers: bool | None = None, only: Iterable[str] | None = None):
    c = self.ppo = shape.ppo
    self.mesh = mesh
    self.only = None if only is None else frozenset(only)
    layers = layers or {}

    def cut(role: str, config: ModelConfig) -> ModelConfig:
      return config if role not in layers else with_layers(config, layers[role])

    model_config = cut("policy", shape.model)
    dtype = DTYPES[shape.dtype]
    shared_value_head = c.uses_critic and shape.critic is None

    def build():
      model = CausalLM(model_config, dtype=dtype, param_dtype=jnp.float32, remat=shape.remat,
                       rngs=nnx.Rngs(0))
      if shape.lora is not None:
        add_lora(model, shape.lora, rngs=nnx.Rngs(0))
      if shared_value_head:
        model.add_value_head()
      return model

    def scalar(config: ModelConfig, head_init: str):
      return nnx.eval_shape(lambda: ScalarModel(config, head_init=head_init, dtype=dtype,
                                                param_dtype=jnp.float32, remat=shape.remat,
                                                rngs=nnx.Rngs(0)))

    model = nnx.eval_shape(build)
    trainable = (nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))
                 if shape.lora is not None else nnx.Param)
    train_scan = c.train_scan_layers if scan_layers is None else scan_layers
    rollout_scan = c.rollout_scan_layers if scan_layers is None else scan_layers
    with layer_loop(model, train_scan):
      graphdef, params, rest = nnx.split(model, trainable, ...)
    with layer_loop(model, rollout_scan):
      self.sampler_graphdef = nnx.split(model)[0]
    value_graphdef = value_params = value_rest = None
    if c.uses_critic and shape.critic is not None:
      critic = scalar(cut("critic", shape.critic), "reward")
      with layer_loop(critic, train_scan):
        value_graphdef, value_params, value_rest = nnx.split(critic, nnx.Param, ...)
    # Each reward model scores with its own layer loop (as loaded: `jax_ppo.rewards.scorers`).
    scorers = []
    for i, m in enumerate(shape.reward_models):
      reward_model = scalar(cut(f"reward_{i}", m), "reward")
      with layer_loop(reward_model, scan_layers):
        scorers.append(nnx.split(reward_model))
    self.reward_graphdefs = [g for g, _ in scorers]
    optimizer, schedule = make_optimizer(c.optimizer, c.total_optimizer_steps)
    self.steps = PPOSteps(c, policy_graphdef=graphdef, value_graphdef=value_graphdef,
                          shared_value_head=shared_value_head, lora=shape.lora is not None,
                          optimizer=optimizer, schedule=schedule, mesh=mesh)
    state = jax.eval_shape(lambda p, v: init_train_state(
        c, optimizer, policy=p, value=v, rng=jax.random.PRNGKey(c.seed)), params, value_params)
    self.state = placed_abstract(state, "params", mesh)
    # One reward model's state, or several by source name (`CombinedScorer.state`).
    reward = {f"reward_{i}": r for i, (_, r) in enumerate(scorers)}
    reward = reward.get("reward_0") if len(reward) == 1 else reward or None
    self.frozen = placed_abstract(
        FrozenParams(policy_rest=rest, ref=None if shape.lora is not None else params,
                     value_rest=value_rest,
                     reward=reward),
        "params", mesh)
    self.sampling = sampling_config(c)
    self.model_config, self.dtype = model_config, dtype
    self.prompt_length = shape.prompt_length

  @property
  def reward_states(self) -> list:
    """The reward models' placed abstract states, in `RunShape.reward_models` order."""
    reward = self.frozen.reward
    if reward is None:
      return []
    return list(reward.values()) if len(self.reward_graphdefs) > 1 else [reward]

  @property
  def resident_bytes(self) -> dict[str, int]:
    """Per-chip bytes of the arrays a run holds between programs: the policy's trainable
    parameters, a separate critic's parameters, the optimizer state (both), the reference, the
    reward models, and the frozen rest (LoRA's base weights)."""
    optional = lambda tree: 0 if tree is None else shard_bytes(tree)  # noqa: E731
    return {"params": shard_bytes(self.state.policy),
            "critic": optional(self.state.value) + optional(self.frozen.value_rest),
            "optimizer": shard_bytes(self.state.opt_state),
            "reference": optional(self.frozen.ref),
            "reward": sum(shard_bytes(r) for r in self.reward_states),
            "frozen": shard_bytes(self.frozen.policy_rest)}

  def _abstract(self, shape, dtype, role: str = "batch"):
    return placed_abstract(jax.ShapeDtypeStruct(shape, dtype), role, self.mesh)

  def _mesh_jit(self, fn: Callable, roles: dict) -> Callable:
    return MeshJit(fn, self.mesh, **roles, keep_unused=True).lower

  def programs(self, *, pieces: bool | Iterable[str] = False) -> dict[str, Program]:
    """The run's programs by name, with the loop bodies (`PIECES`) that `loop_corrected` scales:
    all of them (`pieces=True`) or those named ("decode_step": every decode loop's step,
    `decode_step_k`; `decode_piece(k)`: loop `k`'s)."""
    c, mesh, sampling = self.ppo, self.mesh, self.sampling
    p, b, s, t = c.prompts_per_update, c.batch_size, self.prompt_length, sampling.max_new_tokens
    policy = (self.state.policy, self.frozen.policy_rest)
    resident = sum(self.resident_bytes.values())
    out = {}
    # The sampler's mesh: the run's, or its devices regrouped for a tensor-parallel rollout,
    # which takes a copy of the policy (matrices in the compute dtype) made by `decode_state`
    # while the run's own stays resident.
    gen_mesh = sampler_mesh(mesh, sampling, self.model_config)
    gen_policy, gen_outside = policy, resident - shard_bytes(policy)
    if gen_mesh is not mesh:
      place = decode_state_jit(policy, gen_mesh, self.dtype)
      out["decode_state"] = Program(place.lower, (policy,), resident - shard_bytes(policy))
      gen_policy = placed_abstract(
          jax.eval_shape(functools.partial(compute_weights, dtype=self.dtype), policy),
          "params", gen_mesh)
      gen_outside = resident
    key = placed_abstract(jax.eval_shape(lambda: jax.random.PRNGKey(0)), "replicated", gen_mesh)
    ids = placed_abstract(jax.ShapeDtypeStruct((p, s), jnp.int32), "batch", gen_mesh)
    gen = MeshJit(functools.partial(generate, self.sampler_graphdef, config=sampling,
                                    mesh=gen_mesh),
                  gen_mesh, in_roles=("params", "batch", "batch", "replicated"),
                  out_roles="batch", keep_unused=True).lower
    out["generate"] = Program(gen, (gen_policy, ids, ids, key), gen_outside)
    rollout = Rollout(
        prompt_ids=self._abstract((b, s), jnp.int32), prompt_mask=self._abstract((b, s), jnp.int32),
        response_ids=self._abstract((b, t), jnp.int32),
        response_mask=self._abstract((b, t), jnp.bool_),
        logprobs=self._abstract((b, t), jnp.float32),
        positions=self._abstract((b, s + t), jnp.int32), has_stop=self._abstract((b,), jnp.bool_))
    scores = self._abstract((b,), jnp.float32)
    seq = self._abstract((b, s + t), jnp.int32)
    for i, (graphdef, reward) in enumerate(zip(self.reward_graphdefs, self.reward_states,
                                               strict=True)):
      # The scorer reads the policy's ids (a reward model with a tokenizer of its own reads its
      # re-tokenized rows, at most its context long: about as many).
      out["score" if len(self.reward_graphdefs) == 1 else f"score_{i}"] = Program(
          self._mesh_jit(functools.partial(score_rows, graphdef),
                         dict(in_roles=("params", "batch", "batch"), out_roles="batch")),
          (reward, seq, seq), resident - shard_bytes(reward))
    steps, state, frozen = self.steps, self.state, self.frozen
    with rules.gather_layers(mesh):
      batch = jax.eval_shape(steps.compute_experience, state, frozen, rollout, scores)[0]
    batch = placed_abstract(batch, "batch", mesh)
    kl = self._abstract((), jnp.float32, "replicated")
    roles = PROGRAM_ROLES
    if steps.fuses_first_epoch:
      out["experience_update"] = Program(
          self._mesh_jit(steps.experience_and_update, roles["experience_update"]),
          (state, frozen, rollout, scores))
    else:
      out["experience"] = Program(self._mesh_jit(steps.compute_experience, roles["experience"]),
                                  (state, frozen, rollout, scores))
      out["update"] = Program(
          self._mesh_jit(functools.partial(steps.run_update, fresh=True), roles["update"]),
          (state, frozen, batch, kl))
    if c.replay_buffer_size and c.replay_batches_per_update:
      out["replay_update"] = Program(
          self._mesh_jit(functools.partial(steps.run_update, fresh=False),
                         roles["replay_update"]), (state, frozen, batch, kl))
    if pieces:
      wanted = PIECES if pieces is True else tuple(pieces)
      chosen = lambda k: k in wanted or (k.startswith("decode_step_")  # noqa: E731
                                         and "decode_step" in wanted)
      out.update({k: v for k, v in self._pieces(gen_policy, key, batch, kl, gen_mesh).items()
                  if chosen(k)})
    if self.only is not None:
      out = {k: v for k, v in out.items() if k in self.only or is_piece(k)}
    return out

  def _pieces(self, policy, key, batch, kl, gen_mesh: Mesh) -> dict[str, Program]:
    """The loop bodies; the decode steps on the sampler's mesh `gen_mesh` (with `policy` and
    `key` placed there), the update's on the run's."""
    c, mesh, steps = self.ppo, self.mesh, self.steps
    b, s, t = c.batch_size, self.prompt_length, self.sampling.max_new_tokens
    cache = jax.eval_shape(lambda: new_cache(self.model_config, batch_size=b,
                                             max_length=s + t - 1, dtype=self.dtype))
    cache = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         cache, rules.cache_shardings(cache, gen_mesh))
    on_gen = lambda shape, dt, role="batch": placed_abstract(  # noqa: E731
        jax.ShapeDtypeStruct(shape, dt), role, gen_mesh)
    rows = lambda dt: on_gen((b,), dt)  # noqa: E731
    carry = DecodeCarry(step=on_gen((), jnp.int32, "replicated"), token=rows(jnp.int32),
                        done=rows(jnp.bool_), done_before=rows(jnp.bool_),
                        tokens=on_gen((b, t), jnp.int32),
                        logprobs=on_gen((b, t), jnp.float32), cache=cache)
    graphdef, sampling = self.sampler_graphdef, self.sampling
    # As `generate` runs its loop body: the weight matrices already in the compute dtype (XLA
    # hoists their loop-invariant converts out of the decode loop) and the carry (the KV cache)
    # in the layout the loop chooses, not converted and relaid out on every step.
    matrix = lambda x: x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)  # noqa: E731
    policy = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, self.dtype if matrix(x) else x.dtype, sharding=x.sharding), policy)

    def decode_step(policy, carry, rng, *, attend_length):
      return decode_body(nnx.merge(graphdef, *policy), carry, rng=rng, config=sampling,
                         attend_length=attend_length)

    sharding = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    auto = lambda tree: jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), tree)  # noqa: E731

    def decode_lower(attend_length):
      """Loop `k`'s step: attending over its segment's first `attend_length` cache slots."""
      decode_jit = jax.jit(functools.partial(decode_step, attend_length=attend_length),
                           in_shardings=(sharding(policy), auto(carry), sharding(key)),
                           out_shardings=auto(carry), donate_argnums=(1,))

      def lower(*args):
        with rules.gather_layers(gen_mesh):
          return decode_jit.lower(*args)
      return lower

    micro = placed_abstract(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((c.microbatch_size, *x.shape[1:]), x.dtype), batch),
        "batch", mesh)
    coefs = placed_abstract(jax.eval_shape(functools.partial(coefficients, c), self.state),
                            "replicated", mesh)

    def microbatch_grad(params, frozen, mb, coefs):
      return jax.value_and_grad(steps.micro_loss, has_aux=True)(params, frozen, mb, 1.0, coefs)

    def optimizer_step(state, grads, loss):
      return steps.updater.apply_gradients(state, grads, {"loss/total_avg": loss})

    segments = segment_schedule(s, t, sampling.decode_segments)
    return {
        **{decode_piece(k): Program(decode_lower(seg.attend_length), (policy, carry, key))
           for k, seg in enumerate(segments)},
        "microbatch_grad": Program(
            self._mesh_jit(microbatch_grad, dict(in_roles=("params", "params", "batch",
                                                           "replicated"),
                                                 out_roles=("replicated", "params"))),
            (self.state.params, self.frozen, micro, coefs)),
        "optimizer_step": Program(
            self._mesh_jit(optimizer_step, dict(in_roles=("params", "params", "replicated"),
                                                out_roles=("params", "replicated"),
                                                donate_argnums=(0,))),
            (self.state, self.state.params, kl)),
    }


def score_rows(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array,
               mask: jax.Array) -> jax.Array:
  """A reward model's scores `[B]` of rows `ids`, `mask` `[B, L]` (the scorer's program,
  `jax_ppo.rewards.scorers.RewardModelScorer`)."""
  return nnx.merge(graphdef, state).score(ids, mask)


def layer_costs(shape: RunShape, mesh: Mesh, *, topology: str,
                only: Iterable[str] | None = None) -> dict[str, Cost]:
  """XLA costs of the programs (those named in `only`, or all) and of their loop bodies with
  trips (`loop_trips`) at every model's full depth: extrapolated from variants compiled with 1
  and 2 unrolled layers (`jax_ppo.diagnostics.plan.grouped_depth_costs`), except the decode
  loops' steps, each compiled unrolled at full depth at its own cache prefix (at 1 and 2 layers
  a whole KV cache fits in a TPU core's on-chip memory, where the compiler keeps it: the depth
  difference is then not a layer's HBM traffic)."""
  names = RunPrograms(shape, mesh, only=only).programs().keys()
  trips = loop_trips(shape.ppo, names, max_new_tokens=sampling_config(shape.ppo).max_new_tokens)
  pieces = {p for t in trips.values() for p in t}
  decode = sorted(p for p in pieces if p.startswith("decode_step_"))
  costs = grouped_depth_costs(
      lambda layers: RunPrograms(shape, mesh, layers=layers, scan_layers=False,
                                 only=names).programs(pieces=pieces - set(decode)),
      model_depths(shape), topology=topology)
  if decode:
    steps = RunPrograms(shape, mesh, scan_layers=False, only=names).programs(pieces=decode)
    for name in decode:
      costs[name] = xla_cost(compile_program(name, steps[name], topology=topology))
  return costs


def rows_divided(shape: RunShape, k: int, *, row_shards: int) -> RunShape | None:
  """`shape` with `1/k` of its rows (the batch; so the prompts, minibatches and microbatches) and
  the same loop trips (epochs, minibatches, accumulation steps, decode steps), for
  `row_extrapolated_costs`; None when the rows do not divide so: the batch by `k` into groups of
  `n_samples` and minibatches, or a microbatch over the `row_shards` chips its rows are split
  over (`batch_axis_size`)."""
  ppo = shape.ppo
  if ppo.batch_size % k:
    return None
  try:
    small = dataclasses.replace(ppo, batch_size=ppo.batch_size // k)
  except ValueError:
    return None
  if small.microbatch_size % row_shards or small.prompts_per_update < 1:
    return None
  return dataclasses.replace(shape, ppo=small)


def memory_peaks(shape: RunShape, topology: str, *, devices: list) -> dict[str, int]:
  """Per-chip peak bytes of each program of `shape` on the slice, compiled as the run compiles
  them, without costs (`jax_ppo.diagnostics.plan.shape_peaks`)."""
  return shape_peaks(RunPrograms, shape, topology, devices=devices)


def plan_run(shape: RunShape, topology: str, *, devices: list | None = None,
             advice: bool = True, only: Iterable[str] | None = None) -> Plan:
  """Compiles the programs of `shape` for the TPU slice or GPU nodes `topology` and reports them
  per chip.

  Args:
    shape: the run (model shapes, PPO hyperparameters, prompt length, dtype, mesh sizes).
    topology: a TPU slice name libtpu knows, e.g. "v5e:2x4", "v5p:2x2x4", or GPU nodes,
      e.g. "h100:8", "h200:2x8" (`jax_ppo.diagnostics.gpu_topology`; memory only, no costs).
    devices: the slice's devices (default: `topology_devices(topology)`).
    advice: when the run does not fit, search the change that makes it fit
      (`jax_ppo.diagnostics.advice.advise`, re-planning the memory of each candidate).
    only: plan these programs alone (`RunPrograms`' `only`; None: all the run's).

  Raises:
    PlanError: libtpu (or the CUDA plugin) missing, libtpu in use, an unknown topology or
      chip, a mesh that does not fit, a program that does not compile (naming it and the
      topology).
  """
  devices = topology_devices(topology) if devices is None else devices
  divisor = []  # `k` when the costs were extrapolated from 1/k and 2/k of the rows

  def costs(run: RunPrograms, mesh: Mesh) -> dict[str, Cost] | None:
    at = lambda s: layer_costs(s, mesh, topology=topology, only=only)  # noqa: E731
    try:
      layers = at(shape)
    except DoesNotFit:  # the unrolled, unchunked variants need more HBM than the run's programs
      try:
        layers, k = row_extrapolated_costs(
            at, lambda k: rows_divided(shape, k, row_shards=batch_axis_size(mesh)))
      except DoesNotFit as e:
        logger.warning("%s: the plan has no costs: its cost variants do not compile at any "
                       "fraction of the rows (%s)", topology, e)
        return None
      divisor.append(k)
    return loop_corrected(layers, shape.ppo, max_new_tokens=run.sampling.max_new_tokens)

  plan = plan_programs(functools.partial(RunPrograms, only=only), shape, topology,
                       devices=devices, costs=costs, advice=advice)
  return dataclasses.replace(plan, costs_rows_divisor=divisor[-1]) if divisor else plan


__all__ = [
    "RunPrograms",
    "RunShape",
    "decode_piece",
    "decode_segments",
    "is_piece",
    "layer_costs",
    "PIECES",
    "loop_corrected",
    "loop_trips",
    "memory_peaks",
    "model_depths",
    "plan_run",
    "rows_divided",
    "run_shape",
    "sampling_config",
    "score_rows",
]
