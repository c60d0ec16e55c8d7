r"""The compiled steps of a reward-model run: one optimizer step, evaluation sums and scores.

One step minimises the pairs' mean Bradley-Terry loss (`jax_ppo.reward_model.pairwise`)

.. math::
   \mathcal{L} = \frac{1}{N} \sum_{i=1}^{N} -\log \sigma\bigl(r_c^{(i)} - r_r^{(i)} - m_i\bigr)

over the step's `N = batch_size` pairs, with the training kit (`jax_ppo.training.state`): with
`accumulation_steps = k > 1` the pairs go through the model in `k` microbatches of `N / k`
(`microbatches` + `accumulate_gradients`), each contributing its share
:math:`\sum_{i \in \text{mb}} \ell_i / N`, so the summed gradient is the whole batch's; the
update is `apply_gradients` (AdamW behind the global-norm clip, skipped bit for bit when the
loss or gradient is not finite).

Without a mesh the programs are `jax.jit`s. On a mesh they are `jax_ppo.parallel.jit.MeshJit`s,
as PPO's (`jax_ppo.ppo.programs`): the state and the frozen rest placed by the logical-axis
rules (role "params"), the pairs split on rows over `data` x `fsdp` ("batch"), metrics and sums
replicated. XLA's SPMD partitioner then takes the loss's mean over the global batch: the step
equals the single-device step (`tests/reward_model/test_mesh.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.models.lora import has_lora
from jax_ppo.models.transformer import layer_loop
from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.rules import constrain_rows
from jax_ppo.reward_model.pairwise import PreferencePairs, bradley_terry_loss, pair_scores
from jax_ppo.training.loop import SKIPPED_METRIC
from jax_ppo.training.state import (
    LR_METRIC,
    StageState,
    accumulate_gradients,
    apply_gradients,
    microbatches,
)

Array = jax.Array


def split_trainable(model: nnx.Module, *, scan_layers: bool | None
                    ) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """`(graphdef, params, rest)` of a reward model (a `ScalarModel`; `nnx.split` with the layer
  loop `scan_layers`, None: the model's own): `params` every `nnx.Param`, or, when the model has
  LoRA adapters (`add_lora`), the adapters and the score head (which is new, so it trains);
  `rest` the other variables (LoRA's frozen base weights).

  The split `RewardModelTrainer` trains and `jax_ppo.diagnostics.stage_plan` compiles (on an
  abstract model from `nnx.eval_shape` as well as a loaded one)."""
  trainable = (nnx.Any(nnx.LoRAParam, nnx.PathContains("score_head")) if has_lora(model)
               else nnx.Param)
  with layer_loop(model, scan_layers):
    return nnx.split(model, trainable, ...)


class RewardModelSteps:
  """The compiled functions of a reward-model run (graph definition and optimizer bound).

  - `train_step(state, rest, pairs) -> (state, metrics)`: one AdamW step on the pairs' mean
    Bradley-Terry loss (the state is donated). A step whose loss or gradient is not finite
    leaves the parameters and optimizer state unchanged and reports `skipped_updates = 1`.
    Metrics: `train/loss`, `train/accuracy`, `train/margin`, `train/chosen`, `train/rejected`,
    `train/grad_norm`, `LR_METRIC` (the step's learning rate after `lr_scale`) and
    `SKIPPED_METRIC`.
  - `eval_sums(params, rest, pairs, weight) -> sums`: weighted sums `{loss, accuracy, pairs}`
    over the `[B]` pairs (`weight` 0 on padding rows).
  - `scores(params, rest, ids, mask) -> [B]`: the model's scores of `[B, S]` rows.

  Args:
    graphdef: the `ScalarModel`'s graph (`nnx.split(model, trainable, ...)`).
    optimizer: the optax transformation (`jax_ppo.training.optim.make_optimizer`).
    schedule: its learning-rate schedule.
    accumulation_steps: microbatches per step; must divide the step's pairs.
    mesh: compile for this device mesh (None: one device).
  """

  def __init__(self, *, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
               schedule: optax.Schedule, accumulation_steps: int = 1, mesh: Mesh | None = None):
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.schedule = schedule
    self.accumulation_steps = accumulation_steps
    self.mesh = mesh
    if mesh is None:
      self.train_step = jax.jit(self.train_impl, donate_argnums=0)
      self.eval_sums = jax.jit(self.eval_impl)
      self.scores = jax.jit(self.scores_impl)
    else:
      self.train_step = MeshJit(self.train_impl, mesh, in_roles=("params", "params", "batch"),
                                out_roles=("params", "replicated"), donate_argnums=(0,))
      self.eval_sums = MeshJit(self.eval_impl, mesh,
                               in_roles=("params", "params", "batch", "batch"),
                               out_roles="replicated")
      self.scores = MeshJit(self.scores_impl, mesh,
                            in_roles=("params", "params", "batch", "batch"), out_roles="batch")

  def scores_impl(self, params: nnx.State, rest: nnx.State, ids: Array, mask: Array) -> Array:
    """Scores `[B]` float32 of `ids`, `mask` `[B, S]` (uncompiled; `scores` compiles it)."""
    return nnx.merge(self.graphdef, params, rest).score(ids, mask)

  def loss(self, params: nnx.State, rest: nnx.State, pairs: PreferencePairs,
           weight: Array | None, total: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """`bradley_terry_loss` of the model's scores of `pairs` (`weight`, `total` as there)."""
    chosen, rejected = pair_scores(nnx.merge(self.graphdef, params, rest), pairs)
    return bradley_terry_loss(chosen, rejected, margin=pairs.margin, weight=weight, total=total)

  def train_impl(self, state: StageState, rest: nnx.State,
                 pairs: PreferencePairs) -> tuple[StageState, dict[str, Array]]:
    """One optimizer step on `pairs` `[N, S]` (uncompiled; `train_step` compiles it)."""
    k = self.accumulation_steps
    grad_fn = jax.value_and_grad(self.loss, has_aux=True)
    if k == 1:  # the whole batch at once (no scan: the plain step's program)
      (loss, metrics), grads = grad_fn(state.params, rest, pairs, None)
    else:
      n = pairs.margin.shape[0]
      total = jnp.asarray(n, jnp.float32)  # every training pair is real

      def micro_grad(params, mb):
        return grad_fn(params, rest, mb, jnp.ones(mb.margin.shape, jnp.float32), total)

      xs = constrain_rows(microbatches(pairs, k), self.mesh, axis=1)
      (loss, metrics), grads = accumulate_gradients(micro_grad, state.params, xs)
    new, finite, grad_norm = apply_gradients(state, self.optimizer, grads, loss=loss)
    out = {f"train/{key}": v for key, v in metrics.items() if key != "pairs"}
    out.update({
        "train/loss": loss, "train/grad_norm": grad_norm,
        LR_METRIC: self.schedule(state.step) * state.lr_scale,
        SKIPPED_METRIC: 1.0 - finite.astype(jnp.float32),
    })
    return new, out

  def eval_impl(self, params: nnx.State, rest: nnx.State, pairs: PreferencePairs,
                weight: Array) -> dict[str, Array]:
    """Weighted sums `{loss, accuracy, pairs}` (uncompiled; `eval_sums` compiles it)."""
    loss, m = self.loss(params, rest, pairs, weight)
    return {"loss": loss * m["pairs"], "accuracy": m["accuracy"] * m["pairs"],
            "pairs": m["pairs"]}


__all__ = ["RewardModelSteps", "split_trainable"]
