"""Preference-optimisation losses on sequence log-probs: DPO, cDPO, IPO and the hinge form.

Inputs are sequence log-probs `[B]`: the sum over a response's valid tokens of its token
log-probs, for the chosen (`c`) and the rejected (`r`) response of each pair, under the policy
(`pi`) and the frozen reference (`ref`). Every form is a function of the implicit reward margin

.. math::  h = (\\log\\pi_c - \\log\\pi^{ref}_c) - (\\log\\pi_r - \\log\\pi^{ref}_r).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ppo.core import _checks

Array = jax.Array

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
"""The `loss_type`s of `dpo_loss`."""


def dpo_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    ref_chosen_logps: Array,
    ref_rejected_logps: Array,
    *,
    beta: float | Array = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Array, dict[str, Array]]:
  r"""Direct preference optimisation and its variants, as a loss to minimise (mean over `B`).

  With :math:`h` the margin of the module docstring and :math:`\sigma` the logistic function:

  * `"sigmoid"`: DPO (Rafailov et al. 2023),
    :math:`-(1 - \varepsilon)\log\sigma(\beta h) - \varepsilon\log\sigma(-\beta h)`, where the
    label smoothing :math:`\varepsilon > 0` gives conservative DPO (cDPO, Mitchell 2023): the
    preference labels are taken to be wrong with probability :math:`\varepsilon`;
  * `"ipo"`: IPO (Azar et al. 2023), :math:`(h - \frac{1}{2\beta})^2`, which regresses the
    margin to a finite target instead of pushing it to infinity;
  * `"hinge"`: SLiC (Zhao et al. 2023), :math:`\max(0, 1 - \beta h)`.

  The reference log-probs are constants (`stop_gradient`); gradients flow through the policy's.

  Args:
    policy_chosen_logps: `[B]` sequence log-probs of the chosen responses under the policy.
    policy_rejected_logps: `[B]` the same for the rejected responses.
    ref_chosen_logps: `[B]` sequence log-probs of the chosen responses under the reference.
    ref_rejected_logps: `[B]` the same for the rejected responses.
    beta: > 0, the strength of the KL constraint to the reference (DPO's temperature; IPO's
      regulariser).
    loss_type: "sigmoid", "ipo" or "hinge" (`DPO_LOSS_TYPES`).
    label_smoothing: in [0, 0.5), the assumed share of flipped labels ("sigmoid" only; a
      non-zero value with another `loss_type` is an error when known at trace time).

  Returns:
    `(loss, metrics)` with the metric names TRL's DPO trainer logs: `rewards/chosen` and
    `rewards/rejected` (means of the implicit rewards :math:`\beta(\log\pi - \log\pi^{ref})`),
    `rewards/margins` (mean of their difference), `rewards/accuracies` (share of pairs whose
    chosen reward exceeds the rejected one), `logps/chosen` and `logps/rejected` (means of the
    policy's sequence log-probs), and `dpo_loss`.
  """
  arrays = dict(policy_chosen_logps=policy_chosen_logps,
                policy_rejected_logps=policy_rejected_logps, ref_chosen_logps=ref_chosen_logps,
                ref_rejected_logps=ref_rejected_logps)
  _checks.check_rank("policy_chosen_logps", policy_chosen_logps, 1, "[B]")
  _checks.check_same_shape(**arrays)
  _checks.check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
  _checks.check_scalar_range("beta", beta, low=0.0, low_inclusive=False)
  _checks.check_scalar_range("label_smoothing", label_smoothing, low=0.0, high=0.5,
                             high_inclusive=False)
  if (loss_type != "sigmoid" and _checks.is_concrete(label_smoothing)
      and float(label_smoothing) != 0.0):
    raise ValueError(f"`label_smoothing` ({label_smoothing}) applies to loss_type 'sigmoid' "
                     f"(cDPO) only, got loss_type {loss_type!r}; set it to 0.")
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  pi_c, pi_r = f32(policy_chosen_logps), f32(policy_rejected_logps)
  ref_c = jax.lax.stop_gradient(f32(ref_chosen_logps))
  ref_r = jax.lax.stop_gradient(f32(ref_rejected_logps))
  chosen, rejected = pi_c - ref_c, pi_r - ref_r
  h = chosen - rejected
  beta = f32(beta)
  if loss_type == "sigmoid":
    per_pair = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h)
                - label_smoothing * jax.nn.log_sigmoid(-beta * h))
  elif loss_type == "ipo":
    per_pair = jnp.square(h - 1.0 / (2.0 * beta))
  else:
    per_pair = jax.nn.relu(1.0 - beta * h)
  loss = jnp.mean(per_pair)
  reward_c = jax.lax.stop_gradient(beta * chosen)
  reward_r = jax.lax.stop_gradient(beta * rejected)
  metrics = {
      "rewards/chosen": jnp.mean(reward_c),
      "rewards/rejected": jnp.mean(reward_r),
      "rewards/margins": jnp.mean(reward_c - reward_r),
      "rewards/accuracies": jnp.mean((reward_c > reward_r).astype(jnp.float32)),
      "logps/chosen": jnp.mean(jax.lax.stop_gradient(pi_c)),
      "logps/rejected": jnp.mean(jax.lax.stop_gradient(pi_r)),
      "dpo_loss": loss,
  }
  return loss, metrics
