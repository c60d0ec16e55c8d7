"""PPO on gymnax control tasks (CartPole-v1), built on jax_ppo's own core functions.

This is the control-task check of the core: advantages come from `gae_from_dones`, the losses
from `ppo_policy_loss`, `ppo_value_loss` and `entropy_bonus`, log-probabilities from
`gather_logprobs` and advantage whitening from `masked_whiten`, i.e. the same functions the
language-model trainer uses. A discrete action is a "token" with a vocabulary of `A` actions, so
`[N, A]` logits are fed to the core as `[1, N, A]`.

The whole run is one pure function `train(rng)` (Lu et al. 2022, "Discovered Policy
Optimisation", the PureJaxRL recipe): the rollout is a `lax.scan` over `num_steps`, the update a
`lax.scan` over epochs of a `lax.scan` over minibatches, and the training loop a `lax.scan` over
updates, so `jax.jit(jax.vmap(make_train(config)))(keys)` compiles once and trains one agent per
key without leaving the device.

gymnax is an optional dependency (the `test` and `experiments` extras of pyproject.toml); it is
imported when an environment is built, never by `jax_ppo.core`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_ppo.core import (
    entropy_bonus,
    gae_from_dones,
    gather_logprobs,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
)

Array = jax.Array

LOSS_METRICS = (
    "loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "value_clipfrac"
)
"""Per-minibatch loss metrics, averaged over each update's minibatch steps by `train`."""

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {"tanh": jnp.tanh, "relu": jax.nn.relu}


def _require(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ValueError(f"ControlPPOConfig.{field}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControlPPOConfig:
  """Hyperparameters of PPO on a gymnax environment with discrete actions.

  The defaults are PureJaxRL's CartPole-v1 settings (`purejaxrl/ppo.py`), which solve the task
  (mean return close to the 500 cap) in 5e5 environment steps.
  """

  env_name: str = "CartPole-v1"
  """gymnax environment id; it must have a `Discrete` action space."""
  total_timesteps: int = 500_000
  """Environment steps over all environments; the run does `num_updates` full rollouts."""
  num_envs: int = 4
  """Environments stepped in parallel (vmapped) within one agent."""
  num_steps: int = 128
  """Steps per environment in one rollout; a rollout has `num_envs * num_steps` transitions."""
  update_epochs: int = 4
  """Passes over each rollout's transitions."""
  num_minibatches: int = 4
  """Minibatches per epoch; must divide `num_envs * num_steps`."""
  lr: float = 2.5e-4
  """Adam learning rate (at the start of training when `anneal_lr`)."""
  anneal_lr: bool = True
  """Decay the learning rate linearly to 0 over the updates (constant within one update)."""
  adam_eps: float = 1e-5
  """Adam's epsilon."""
  max_grad_norm: float = 0.5
  """Gradients are clipped to this global norm before Adam."""
  gamma: float = 0.99
  """Discount factor in [0, 1]."""
  gae_lambda: float = 0.95
  """GAE lambda in [0, 1]."""
  clip_eps: float = 0.2
  """PPO ratio clip range, > 0."""
  value_clip_eps: float | None = 0.2
  """Clip range of the value loss around the rollout's values; `None` for the plain MSE."""
  ent_coef: float = 0.01
  """Weight of the entropy bonus (subtracted from the loss), >= 0."""
  vf_coef: float = 0.5
  """Weight of the value loss, >= 0."""
  normalize_advantages: bool = True
  """Whiten the advantages of each minibatch (mean 0, std 1) before the policy loss."""
  hidden_sizes: tuple[int, ...] = (64, 64)
  """Widths of the hidden layers of the actor and of the (separate) critic MLP."""
  activation: str = "tanh"
  """Hidden activation: "tanh" or "relu"."""
  log_every: int = 0
  """If > 0, `jax.debug.callback` prints progress every this many updates (once per vmapped
  agent); 0 keeps host callbacks out of the compiled program."""

  def __post_init__(self):
    for name in ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches"):
      value = getattr(self, name)
      _require(
          isinstance(value, int) and value >= 1, name, f"must be a positive int, got {value!r}."
      )
    _require(
        self.total_timesteps >= self.batch_size,
        "total_timesteps",
        f"{self.total_timesteps} is less than one rollout (num_envs * num_steps = "
        f"{self.batch_size}); raise total_timesteps or lower num_envs / num_steps.",
    )
    _require(
        self.batch_size % self.num_minibatches == 0,
        "num_minibatches",
        f"{self.num_minibatches} must divide num_envs * num_steps = {self.num_envs} * "
        f"{self.num_steps} = {self.batch_size}; pick a divisor of {self.batch_size} or change "
        "num_envs / num_steps.",
    )
    _require(self.lr > 0, "lr", f"must be > 0, got {self.lr}.")
    _require(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}.")
    _require(self.max_grad_norm > 0, "max_grad_norm", f"must be > 0, got {self.max_grad_norm}.")
    _require(0.0 <= self.gamma <= 1.0, "gamma", f"must lie in [0, 1], got {self.gamma}.")
    _require(
        0.0 <= self.gae_lambda <= 1.0, "gae_lambda", f"must lie in [0, 1], got {self.gae_lambda}."
    )
    _require(self.clip_eps > 0, "clip_eps", f"must be > 0, got {self.clip_eps}.")
    _require(
        self.value_clip_eps is None or self.value_clip_eps > 0,
        "value_clip_eps",
        f"must be > 0 or None (no clipping), got {self.value_clip_eps}.",
    )
    _require(self.ent_coef >= 0, "ent_coef", f"must be >= 0, got {self.ent_coef}.")
    _require(self.vf_coef >= 0, "vf_coef", f"must be >= 0, got {self.vf_coef}.")
    _require(
        len(self.hidden_sizes) >= 1 and all(int(h) >= 1 for h in self.hidden_sizes),
        "hidden_sizes",
        f"must be a non-empty tuple of positive ints, got {self.hidden_sizes!r}.",
    )
    _require(
        self.activation in ACTIVATIONS,
        "activation",
        f"unknown {self.activation!r}; expected one of {tuple(ACTIVATIONS)}.",
    )
    _require(self.log_every >= 0, "log_every", f"must be >= 0, got {self.log_every}.")

  @property
  def batch_size(self) -> int:
    """Transitions per rollout: `num_envs * num_steps`."""
    return self.num_envs * self.num_steps

  @property
  def minibatch_size(self) -> int:
    """Transitions per gradient step."""
    return self.batch_size // self.num_minibatches

  @property
  def num_updates(self) -> int:
    """Rollout + update cycles: `total_timesteps // batch_size` (the remainder is dropped)."""
    return self.total_timesteps // self.batch_size


# ----------------------------------------------------------------------------------------------
# Episode statistics (what PureJaxRL's LogWrapper reports, kept outside the environment).


class EpisodeStats(NamedTuple):
  """Running episode statistics of `N` auto-resetting environments.

  Attributes:
    episode_return: `[N]` float32, undiscounted return of the episode in progress.
    episode_length: `[N]` int32, steps of the episode in progress.
    returned_episode_return: `[N]` float32, return of the last completed episode (0 before
      the first one ends).
    returned_episode_length: `[N]` int32, length of the last completed episode.
    timestep: `[N]` int32, steps taken by each environment since the start.
  """

  episode_return: Array
  episode_length: Array
  returned_episode_return: Array
  returned_episode_length: Array
  timestep: Array


def init_episode_stats(num_envs: int) -> EpisodeStats:
  """Zero statistics for `num_envs` environments."""
  zf = jnp.zeros((num_envs,), jnp.float32)
  zi = jnp.zeros((num_envs,), jnp.int32)
  return EpisodeStats(zf, zi, zf, zi, zi)


def update_episode_stats(stats: EpisodeStats, reward: Array, done: Array) -> EpisodeStats:
  """Adds one step's `[N]` rewards; where `done` (terminated or truncated) the episode closes.

  A closed episode's return and length move to the `returned_*` fields (they stay there until
  the next episode of that environment closes) and the running sums restart at 0, matching an
  environment that auto-resets on `done`.
  """
  ret = stats.episode_return + reward.astype(jnp.float32)
  length = stats.episode_length + 1
  return EpisodeStats(
      episode_return=jnp.where(done, 0.0, ret),
      episode_length=jnp.where(done, 0, length),
      returned_episode_return=jnp.where(done, ret, stats.returned_episode_return),
      returned_episode_length=jnp.where(done, length, stats.returned_episode_length),
      timestep=stats.timestep + 1,
  )


def final_return(metrics: dict[str, Any], *, last_updates: int = 10) -> np.ndarray:
  """Mean return of the episodes completed in the last `last_updates` updates.

  Args:
    metrics: the metrics of `train` (leading axes `[..., U]`, e.g. `[S, U]` for `S` vmapped
      seeds) with `episode_return_sum` and `episodes`.
    last_updates: how many of the final updates to average over.

  Returns:
    float64 array of shape `[...]`: one figure per agent (NaN if no episode ended).
  """
  total = np.asarray(metrics["episode_return_sum"])[..., -last_updates:].sum(-1)
  count = np.asarray(metrics["episodes"])[..., -last_updates:].sum(-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return total.astype(np.float64) / count


def return_curve(metrics: dict[str, Any], *, window: int = 10) -> np.ndarray:
  """Learning curve: mean return of the episodes completed in a trailing window of updates.

  Args:
    metrics: the metrics of `train`, leading axes `[..., U]`.
    window: number of updates (ending at each update) whose completed episodes are averaged.

  Returns:
    float64 array `[..., U]`; NaN until the first episode completes.
  """
  if window < 1:
    raise ValueError(f"`window` must be >= 1, got {window}.")

  def trailing_sum(x):
    c = np.cumsum(np.asarray(x, np.float64), axis=-1)
    shifted = np.concatenate([np.zeros_like(c[..., :window]), c[..., :-window]], axis=-1)
    return c - shifted[..., : c.shape[-1]]

  total = trailing_sum(metrics["episode_return_sum"])
  count = trailing_sum(metrics["episodes"])
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(count > 0, total / count, np.nan)


# ----------------------------------------------------------------------------------------------
# Network.


class ActorCritic(nnx.Module):
  """Separate actor and critic MLPs with orthogonal initialisation (Engstrom et al. 2020,
  "Implementation Matters in Deep Policy Gradients"; Andrychowicz et al. 2021).

  Hidden layers use gain sqrt(2), the policy head gain 0.01 (near-uniform initial policy) and
  the value head gain 1; biases start at 0.
  """

  def __init__(
      self,
      obs_dim: int,
      num_actions: int,
      *,
      hidden_sizes: Sequence[int] = (64, 64),
      activation: str = "tanh",
      rngs: nnx.Rngs,
  ):
    orth = nnx.initializers.orthogonal
    zeros = nnx.initializers.zeros_init()

    def mlp(out_dim: int, head_gain: float) -> nnx.List:
      sizes = [obs_dim, *hidden_sizes]
      layers = [
          nnx.Linear(i, o, kernel_init=orth(np.sqrt(2.0)), bias_init=zeros, rngs=rngs)
          for i, o in zip(sizes[:-1], sizes[1:], strict=True)
      ]
      layers.append(nnx.Linear(sizes[-1], out_dim, kernel_init=orth(head_gain), bias_init=zeros,
                               rngs=rngs))
      return nnx.List(layers)

    self.activation = activation
    self.actor = mlp(num_actions, 0.01)
    self.critic = mlp(1, 1.0)

  def __call__(self, obs: Array) -> tuple[Array, Array]:
    """Maps `[..., obs_dim]` observations to `([..., A]` logits, `[...]` values)."""
    act = ACTIVATIONS[self.activation]

    def run(layers, x):
      for layer in layers[:-1]:
        x = act(layer(x))
      return layers[-1](x)

    x = obs.astype(jnp.float32)
    return run(self.actor, x), run(self.critic, x)[..., 0]


# ----------------------------------------------------------------------------------------------
# Training.


class Transition(NamedTuple):
  """One rollout step of `N` environments (stacked to `[T, N]` by the rollout scan)."""

  obs: Array  # [N, obs_dim] observation the action was taken from.
  action: Array  # [N] int32 sampled action.
  logprob: Array  # [N] float32 log-probability of `action` under the behaviour policy.
  value: Array  # [N] float32 critic value of `obs`.
  reward: Array  # [N] float32 reward of the step.
  done: Array  # [N] bool, the episode ended (terminated or truncated) with this step.
  returned_episode_return: Array  # [N] float32, EpisodeStats after the step.


def make_env(env_name: str):
  """Builds a gymnax environment and its default parameters; checks the action space."""
  try:
    import gymnax
    from gymnax.environments import spaces
  except ImportError as e:  # pragma: no cover - exercised only without the extra installed.
    raise ImportError(
        "jax_ppo.control needs gymnax: pip install 'jax_ppo[experiments]' (or [test])."
    ) from e
  env, env_params = gymnax.make(env_name)
  if not hasattr(env, "is_truncated"):
    raise ImportError(
        "jax_ppo.control needs gymnax >= 1.0 (separate `terminated` and `truncated` flags); "
        f"found gymnax {getattr(gymnax, '__version__', '?')}."
    )
  if not isinstance(env.action_space(env_params), spaces.Discrete):
    raise ValueError(
        f"ControlPPOConfig.env_name: {env_name!r} has a "
        f"{type(env.action_space(env_params)).__name__} action space; this PPO supports "
        "Discrete actions only."
    )
  return env, env_params


def _batched_resets(env, env_params, key: Array, shape: tuple[int, ...]):
  """`env.reset_env` for `prod(shape)` keys at once; leaves get leading axes `shape`."""
  keys = jax.random.split(key, math.prod(shape))
  obs, state = jax.vmap(env.reset_env, in_axes=(0, None))(keys, env_params)
  return jax.tree.map(lambda x: x.reshape(*shape, *x.shape[1:]), (obs, state))


def _auto_reset_step(env, env_params, key_n, state_n, action_n, reset_obs_n, reset_state_n):
  """One step of `N` environments with auto-reset, as gymnax's `Environment.step` does it,
  except that the reset states are drawn beforehand (see `_batched_resets`).

  Returns `(obs, state, reward, done)` with `done = terminated | truncated`; where `done`, `obs`
  and `state` are the reset ones (the episode's final observation is discarded, as PureJaxRL's
  PPO does: a time-limit truncation is treated as the end of the episode).
  """
  obs, state, reward, terminated, _ = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))(
      key_n, state_n, action_n, env_params
  )
  truncated = jax.vmap(env.is_truncated, in_axes=(0, None))(state, env_params)
  done = jnp.logical_or(terminated, truncated)

  def select(reset_x, x):
    return jnp.where(done.reshape(done.shape + (1,) * (x.ndim - 1)), reset_x, x)

  obs, state = jax.tree.map(select, (reset_obs_n, reset_state_n), (obs, state))
  return obs, state, jnp.asarray(reward, jnp.float32), done


def make_train(config: ControlPPOConfig) -> Callable[[Array], tuple[Any, dict[str, Array]]]:
  """Returns `train(rng) -> (params, metrics)`, a pure function to wrap in `jax.jit`/`jax.vmap`.

  Args:
    config: a `ControlPPOConfig`.

  Returns:
    `train`, which takes a PRNG key and returns the final network parameters (an `nnx.State`)
    and a dict of per-update float32/int32 metrics of shape `[U]` (`U = config.num_updates`):
    `episode_return_sum` and `episodes` (returns and number of the episodes completed in the
    update's rollout; their ratio is PureJaxRL's "returned_episode_returns" averaged over
    completed episodes, see `final_return`), `returned_episode_returns` (the LogWrapper field
    averaged over all steps and environments, as PureJaxRL's plots do), `timestep`,
    `learning_rate`, `loss`, `policy_loss`, `value_loss`, `entropy`, `approx_kl`, `clipfrac`
    and `value_clipfrac` (means over the update's minibatch steps).
  """
  env, env_params = make_env(config.env_name)
  obs_dim = int(np.prod(env.observation_space(env_params).shape))
  num_actions = int(env.action_space(env_params).n)
  n_envs, n_steps, n_mb = config.num_envs, config.num_steps, config.num_minibatches
  grad_steps_per_update = config.update_epochs * n_mb

  def learning_rate(count: Array) -> Array:
    # Constant within an update, linear in the update index, reaching 0 after the last one.
    if not config.anneal_lr:
      return jnp.asarray(config.lr, jnp.float32)
    frac = 1.0 - (count // grad_steps_per_update) / config.num_updates
    return config.lr * frac

  tx = optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adam(learning_rate=learning_rate, eps=config.adam_eps),
  )

  def train(rng: Array) -> tuple[Any, dict[str, Array]]:
    rng, init_key, reset_key = jax.random.split(rng, 3)
    model = ActorCritic(
        obs_dim,
        num_actions,
        hidden_sizes=config.hidden_sizes,
        activation=config.activation,
        rngs=nnx.Rngs(params=init_key),
    )
    graphdef, params = nnx.split(model)
    # The parameters stay a pytree of per-layer arrays. (One flat vector would mean fewer, larger
    # optimizer ops for a single agent, but under `jax.vmap` over seeds its slices become strided
    # copies, which measured slower.)
    opt_state = tx.init(params)

    def apply(p, obs):
      return nnx.merge(graphdef, p)(obs)

    def env_step(carry, xs):
      p, env_state, stats, obs = carry
      gumbel_na, step_key_n, reset_obs_n, reset_state_n = xs
      logits_na, value_n = apply(p, obs)
      # Gumbel-max sampling, what `jax.random.categorical` does, with the noise of the whole
      # rollout drawn in one call before the scan.
      action_n = jnp.argmax(logits_na + gumbel_na, axis=-1).astype(jnp.int32)
      logprob_n = gather_logprobs(logits_na[None], action_n[None])[0]
      next_obs, env_state, reward, done = _auto_reset_step(
          env, env_params, step_key_n, env_state, action_n, reset_obs_n, reset_state_n
      )
      stats = update_episode_stats(stats, reward, done)
      transition = Transition(
          obs, action_n, logprob_n, value_n, reward, done, stats.returned_episode_return
      )
      return (p, env_state, stats, next_obs.reshape(n_envs, obs_dim)), transition

    def loss_fn(p, mb):
      obs, action, old_logprob, old_value, advantages, returns = mb  # [1, M, ...]
      logits, values = apply(p, obs)
      mask = jnp.ones(action.shape, jnp.bool_)
      logprobs = gather_logprobs(logits, action)
      if config.normalize_advantages:
        advantages = masked_whiten(advantages, mask, eps=1e-8)
      pg_loss, pg_metrics = ppo_policy_loss(
          logprobs, old_logprob, advantages, mask, clip_eps=config.clip_eps
      )
      v_loss, v_metrics = ppo_value_loss(
          values, old_value, returns, mask, clip_eps=config.value_clip_eps
      )
      entropy, _ = entropy_bonus(logits, mask)
      loss = pg_loss + config.vf_coef * v_loss - config.ent_coef * entropy
      values = {
          "loss": loss,
          "policy_loss": pg_loss,
          "value_loss": v_loss,
          "entropy": entropy,
          "approx_kl": pg_metrics["approx_kl"],
          "clipfrac": pg_metrics["clipfrac"],
          "value_clipfrac": v_metrics["clipfrac"],
      }
      # One [len(LOSS_METRICS)] vector: one scan output to write per minibatch, not seven.
      return loss, jnp.stack([values[k] for k in LOSS_METRICS])

    def minibatch_step(state, mb):
      p, o = state
      grads, metrics = jax.grad(loss_fn, has_aux=True)(p, mb)
      updates, o = tx.update(grads, o, p)
      return (optax.apply_updates(p, updates), o), metrics

    def epoch(carry, perm_key):
      p, o, batch = carry
      perm = jax.random.permutation(perm_key, config.batch_size)
      # [B] -> shuffled -> [num_minibatches, 1, minibatch_size, ...]: rank-2 [1, M] rows for core.
      minibatches = jax.tree.map(
          lambda x: jnp.take(x, perm, axis=0).reshape(n_mb, 1, -1, *x.shape[1:]), batch
      )
      (p, o), metrics = jax.lax.scan(minibatch_step, (p, o), minibatches)
      return (p, o, batch), metrics

    def update(carry, _):
      p, o, env_state, stats, obs, key, step = carry
      key, noise_key, steps_key, reset_key, epoch_key = jax.random.split(key, 5)
      # All the rollout's randomness in a few batched calls (one threefry each) rather than
      # several small ones per step: action noise, step keys and a reset state for every step.
      reset_obs, reset_state = _batched_resets(env, env_params, reset_key, (n_steps, n_envs))
      xs = (
          jax.random.gumbel(noise_key, (n_steps, n_envs, num_actions), jnp.float32),
          jax.random.split(steps_key, (n_steps, n_envs)),
          reset_obs,
          reset_state,
      )
      (p, env_state, stats, obs), traj = jax.lax.scan(env_step, (p, env_state, stats, obs), xs)
      _, last_value = apply(p, obs)
      # The rollout is time-major [T, N]; the core estimators are batch-major [B, T].
      advantages, returns = gae_from_dones(
          traj.reward.T,
          traj.value.T,
          traj.done.T,
          last_value,
          gamma=config.gamma,
          lam=config.gae_lambda,
      )
      flat = lambda x_nt: x_nt.reshape(config.batch_size, *x_nt.shape[2:])
      batch = (
          flat(jnp.swapaxes(traj.obs, 0, 1)),
          flat(traj.action.T),
          flat(traj.logprob.T),
          flat(traj.value.T),
          flat(advantages),
          flat(returns),
      )
      lr = learning_rate(step * grad_steps_per_update)  # what Adam uses during this update
      (p, o, _), loss_metrics = jax.lax.scan(
          epoch, (p, o, batch), jax.random.split(epoch_key, config.update_epochs)
      )
      loss_means = jnp.mean(loss_metrics, axis=(0, 1))
      metrics = {k: loss_means[i] for i, k in enumerate(LOSS_METRICS)}
      done = traj.done
      metrics.update(
          episode_return_sum=jnp.sum(jnp.where(done, traj.returned_episode_return, 0.0)),
          episodes=jnp.sum(done, dtype=jnp.int32),
          returned_episode_returns=jnp.mean(traj.returned_episode_return),
          timestep=(step + 1) * config.batch_size,
          learning_rate=jnp.asarray(lr, jnp.float32),
      )
      if config.log_every:
        jax.lax.cond(
            (step + 1) % config.log_every == 0,
            lambda m: jax.debug.callback(_print_progress, m, config.num_updates),
            lambda m: None,
            {**metrics, "update": step + 1},
        )
      return (p, o, env_state, stats, obs, key, step + 1), metrics

    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(reset_key, n_envs), env_params
    )
    obs = obs.reshape(n_envs, obs_dim)
    carry = (params, opt_state, env_state, init_episode_stats(n_envs), obs, rng, jnp.int32(0))
    carry, metrics = jax.lax.scan(update, carry, None, config.num_updates)
    return carry[0], metrics

  return train


def _print_progress(metrics: dict[str, Any], num_updates: int) -> None:
  episodes = int(metrics["episodes"])
  ret = float(metrics["episode_return_sum"]) / episodes if episodes else float("nan")
  print(
      f"update {int(metrics['update']):5d}/{num_updates}  step {int(metrics['timestep']):8d}  "
      f"return {ret:7.1f}  entropy {float(metrics['entropy']):.3f}  "
      f"approx_kl {float(metrics['approx_kl']):.4f}",
      flush=True,
  )
