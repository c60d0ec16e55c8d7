"""The pieces of one optimizer step that every stage shares.

* `StageState`: what an SFT or reward-model step changes (parameters, optimizer state, the step
  counter, the learning-rate scale a rollback lowers). PPO's `TrainState` holds more (a critic,
  the KL controller, its key) and uses the same functions on its `params`.
* `guarded_update`: one optimizer step that is skipped, bit for bit, when the loss or the
  gradient is not finite, as a `lax.cond` around the step (see its docstring for why not a
  select).
* `microbatches` + `accumulate_gradients`: the gradient-accumulation scan, one
  `value_and_grad` per microbatch, gradients and metrics summed.
* `batch_rows`: the host-side batch order of the offline stages (SFT, reward model): the rows of
  each epoch in a `[seed, epoch]`-seeded permutation.
* `LR_METRIC`: the one name every stage logs its learning rate under (`CRITIC_LR_METRIC`: PPO's
  critic's).

All functions are pure and jittable (except `batch_rows`, which runs on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from jax_ppo.parallel.rules import shard_params

Array = jax.Array

LR_METRIC = "lr"
"""The metric name of the learning rate (after `lr_scale`) in every stage's metrics."""
CRITIC_LR_METRIC = f"{LR_METRIC}/critic"
"""The metric name of PPO's critic learning rate (after `lr_scale`), where the run has a
critic (`PPOOptimizer.critic_learning_rate`)."""


class StageState(struct.PyTreeNode):
  """Everything an SFT or reward-model step changes.

  Attributes:
    params: the trainable variables (every `nnx.Param`, or the LoRA adapters and a new head).
    opt_state: optax state over `params`.
    step: int32, optimizer steps done, skipped ones included (the schedule's clock and the data
      position).
    lr_scale: float32 multiplier of the learning rate (a rollback lowers it).
  """

  params: nnx.State
  opt_state: optax.OptState
  step: Array
  lr_scale: Array


def init_stage_state(optimizer: optax.GradientTransformation, params: nnx.State) -> StageState:
  """A fresh `StageState` (step 0, learning-rate scale 1)."""
  return StageState(params=params, opt_state=optimizer.init(params),
                    step=jnp.zeros((), jnp.int32), lr_scale=jnp.ones((), jnp.float32))


def place_stage_state(state: StageState, mesh: Mesh | None, *frozen: Any) -> tuple:
  """A stage's fresh state placed as the compiled steps return it, with its frozen trees.

  Without a mesh the state's arrays are committed to their devices, as a restored checkpoint's
  are, so a resumed run hands the jitted steps the same argument signature (no recompilation);
  the `frozen` trees (the model's non-trainable rest, a reference) are returned as they are. On
  a mesh the state and every frozen tree are split by the logical-axis rules
  (`jax_ppo.parallel.rules.shard_params`).

  Returns:
    `(state, *frozen)`, placed.
  """
  if mesh is None:
    return (jax.tree.map(lambda x: jax.device_put(x, x.sharding), state), *frozen)
  return (shard_params(state, mesh), *(shard_params(tree, mesh) for tree in frozen))


def guarded_update(
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: optax.OptState,
    grads: Any,
    *,
    loss: Array,
    lr_scale: Array,
) -> tuple[Any, optax.OptState, Array, Array]:
  """One optimizer step, scaled by `lr_scale`, skipped when `loss` or `grads` is not finite.

  A skipped step leaves `params` and `opt_state` unchanged bit for bit. The skip is a
  `lax.cond` around the step, not a select of new against old values: with a select the old
  Adam moments stay live next to the new ones and XLA copies every moment (twice the
  parameters' bytes) on each step; the conditional updates parameters and moments in place. Not
  a zero update either (`x + 0` turns -0.0 into 0.0), and not `optax.apply_if_finite` (it applies
  the non-finite update after `max_consecutive_errors` skips and does not look at the loss). The
  gradient is judged by its global norm, which is NaN or inf exactly when some entry is (or when
  the norm of finite entries overflows float32, a step no clipping could save).

  Args:
    optimizer: the stage's optax transformation.
    params: the trainable parameters (any pytree).
    opt_state: `optimizer`'s state over `params`.
    grads: gradients shaped like `params`.
    loss: float32 scalar loss of the step.
    lr_scale: float32 scalar multiplier of the update.

  Returns:
    `(params, opt_state, finite, grad_norm)`: `finite` is a bool scalar (False: skipped),
    `grad_norm` the gradient's global norm before clipping.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def step(operands):
    params, opt_state, grads, lr_scale = operands
    updates, opt_state = optimizer.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
    return optax.apply_updates(params, updates), opt_state

  def skip(operands):
    params, opt_state, _, _ = operands
    return params, opt_state

  params, opt_state = jax.lax.cond(finite, step, skip, (params, opt_state, grads, lr_scale))
  return params, opt_state, finite, grad_norm


def apply_gradients(state: StageState, optimizer: optax.GradientTransformation, grads: Any, *,
                    loss: Array) -> tuple[StageState, Array, Array]:
  """`guarded_update` on a `StageState`; the step counter advances even when skipped.

  Returns:
    `(state, finite, grad_norm)`.
  """
  params, opt_state, finite, grad_norm = guarded_update(
      optimizer, state.params, state.opt_state, grads, loss=loss, lr_scale=state.lr_scale)
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), finite, grad_norm


def microbatches(batch: Any, num: int, *, axis: int = 0) -> Any:
  """Splits every array of `batch` along `axis` (rows) into `num` microbatches.

  `[..., B, ...] -> [num, ..., B / num, ...]` with the microbatch index first, so that
  `lax.scan` runs over it; microbatch `i` holds rows `[i * B / num, (i + 1) * B / num)`.

  Raises:
    ValueError: `B` is not divisible by `num`.
  """
  def split(x):
    if x is None:
      return None
    rows = x.shape[axis]
    if rows % num:
      raise ValueError(f"{rows} rows cannot be split into {num} equal microbatches.")
    x = jnp.moveaxis(x, axis, 0)
    x = x.reshape(num, rows // num, *x.shape[1:])
    return jnp.moveaxis(x, 1, axis + 1)

  return jax.tree.map(split, batch)


def accumulate_gradients(
    grad_fn: Callable[[Any, Any], tuple[Any, Any]],
    params: Any,
    xs: Any,
) -> tuple[Any, Any]:
  """Sums `grad_fn(params, x)` over the leading axis of `xs` with `lax.scan`.

  Args:
    grad_fn: `grad_fn(params, x) -> (aux, grads)`, e.g. `jax.value_and_grad(loss)` whose value
      is the microbatch's share of the step's loss; `aux` is any pytree of arrays (the loss,
      metrics) and is summed like the gradients.
    params: the parameters the gradients are taken against.
    xs: a pytree whose arrays have the microbatch index first (`microbatches`).

  Returns:
    `(summed aux, summed grads)`. Only one microbatch's activations are live at a time; the
    caller normalises (e.g. by the whole step's token count, never per microbatch).
  """
  first = jax.tree.map(lambda x: x[0], xs)
  aux_shape, _ = jax.eval_shape(grad_fn, params, first)
  zeros = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape),
           jax.tree.map(jnp.zeros_like, params))

  def body(carry, x):
    aux, grads = grad_fn(params, x)
    return jax.tree.map(jnp.add, carry, (aux, grads)), None

  (aux, grads), _ = jax.lax.scan(body, zeros, xs)
  return aux, grads


def batch_rows(seed: int, step: int, batch_size: int, num_rows: int, *,
               epoch_end: str = "wrap") -> np.ndarray:
  """Row indices of the batch of optimizer step `step` (0-based) of an offline stage.

  The rows of epoch `e` are visited in the order `np.random.default_rng([seed, e]).permutation(
  num_rows)`. At the end of an epoch whose rows do not fill the last batch:

  * `epoch_end="wrap"`: the batch goes on with the next epoch's permutation (a stream of
    permutations; every batch is full);
  * `epoch_end="pad"`: the batch is filled with -1 (empty rows that carry no loss), and the next
    step starts the next epoch: `ceil(num_rows / batch_size)` steps per epoch.

  The two agree when `batch_size` divides `num_rows`.
  """
  if epoch_end not in ("wrap", "pad"):
    raise ValueError(f"epoch_end={epoch_end!r} is invalid: use 'wrap' or 'pad'.")
  if epoch_end == "pad":
    per_epoch = -(-num_rows // batch_size)
    epoch, i = divmod(int(step), per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    index = order[i * batch_size:(i + 1) * batch_size]
    return np.concatenate([index, np.full(batch_size - len(index), -1, np.int64)])
  positions = np.arange(step * batch_size, (step + 1) * batch_size)
  out = np.empty(batch_size, np.int64)
  for epoch in np.unique(positions // num_rows):
    perm = np.random.default_rng([seed, int(epoch)]).permutation(num_rows)
    sel = positions // num_rows == epoch
    out[sel] = perm[positions[sel] % num_rows]
  return out


__all__ = [
    "CRITIC_LR_METRIC",
    "LR_METRIC",
    "StageState",
    "accumulate_gradients",
    "apply_gradients",
    "batch_rows",
    "guarded_update",
    "init_stage_state",
    "microbatches",
]
