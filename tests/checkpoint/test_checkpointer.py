"""Tests of `jax_ppo.checkpoint.RunCheckpointer` on small pytrees (no models, no compiles)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from jax_ppo.checkpoint import (
    CheckpointConfigMismatch,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointStructureMismatch,
    RunCheckpointer,
    config_differences,
)
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling


class State(struct.PyTreeNode):
  params: dict
  value: dict | None
  rng: jax.Array
  step: jax.Array


def _state(offset: float = 0.0) -> State:
  return State(
      params={"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + offset,
              "b": jnp.full((3,), 1.5 + offset, jnp.bfloat16)},
      value=None,
      rng=jax.random.PRNGKey(int(offset)),
      step=jnp.asarray(int(offset), jnp.int32),
  )


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_gives_back_structure_dtypes_shardings_and_extra(tmp_path):
  state = _state(3.0)
  extra = {"data_position": 7, "monitor": {"rewards": [[1, 0.5]]}, "note": None}
  with RunCheckpointer(tmp_path, save_every=1, config=PPOConfig()) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(3, state, {"objective/scores": 1.0}, extra)
    ckpt.wait()
    assert ckpt.steps() == [3] and ckpt.latest_step() == 3
    assert ckpt.read_meta(3)["config"]["batch_size"] == PPOConfig().batch_size
  with RunCheckpointer(tmp_path, config=PPOConfig()) as ckpt:  # a new process
    restored, got_extra = ckpt.restore(like=_state(0.0))
  _assert_same(restored, state)
  assert isinstance(restored, State) and restored.value is None
  assert got_extra == extra
  for leaf, like in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert leaf.sharding == like.sharding and leaf.committed


def test_saves_every_n_keeps_the_last_k_and_the_best(tmp_path):
  scores = {2: 1.0, 4: 9.0, 6: float("nan"), 8: 2.0, 10: 3.0, 12: 0.5}
  with RunCheckpointer(tmp_path / "max", save_every=2, keep_last=2,
                       best_metric="objective/scores", async_save=False) as ckpt:
    saved = [s for s in range(1, 13)
             if ckpt.maybe_save(s, _state(s), {"objective/scores": scores.get(s, 0.0)})]
    assert saved == [2, 4, 6, 8, 10, 12]
    assert ckpt.steps() == [4, 10, 12]  # the last two and the best (NaN never wins)
    assert ckpt.best_step() == 4
    _assert_same(ckpt.restore(4, like=_state())[0], _state(4))
  with RunCheckpointer(tmp_path / "min", save_every=2, keep_last=1,
                       best_metric="loss", best_mode="min", async_save=False) as ckpt:
    for s in (2, 4, 6):
      ckpt.maybe_save(s, _state(s), {"loss": {2: 5.0, 4: 0.1, 6: 3.0}[s]})
    assert ckpt.steps() == [4, 6] and ckpt.best_step() == 4
  with RunCheckpointer(tmp_path / "plain", save_every=3, keep_last=2) as ckpt:
    for s in range(1, 10):
      ckpt.maybe_save(s, _state(s))
    assert not ckpt.maybe_save(9, _state(9))  # already saved
    assert ckpt.save(10, _state(10))  # forced, off the interval
    ckpt.wait()
    assert ckpt.steps() == [9, 10] and ckpt.best_step() is None
    with pytest.raises(CheckpointError, match="later step 10"):
      ckpt.save(5, _state(5))


def test_async_save_copies_the_buffers_before_returning(tmp_path):
  big = {"a": jnp.arange(1 << 20, dtype=jnp.float32), "b": jnp.ones((256, 256))}
  want = jax.tree.map(lambda x: np.array(x, copy=True), big)
  overwrite = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)
  with RunCheckpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.save(1, big)
    gone = overwrite(big)  # donates (and may reuse) the saved buffers at once
    jax.block_until_ready(gone)
    ckpt.wait()
    restored, _ = ckpt.restore(like=gone)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), want)


def test_another_config_is_refused_naming_the_fields_and_nothing_is_lost(tmp_path):
  config = PPOConfig(optimizer=PPOOptimizer(learning_rate=1e-6),
                     sampling=PPOSampling(stop_token_ids=(2,)))
  with RunCheckpointer(tmp_path, config=config) as ckpt:
    ckpt.save(1, _state(1), extra={"data_position": 1})
  files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  other = PPOConfig(optimizer=PPOOptimizer(learning_rate=2e-6),
                    sampling=PPOSampling(stop_token_ids=(2, 5)))
  with pytest.raises(CheckpointConfigMismatch) as e:
    RunCheckpointer(tmp_path, config=other)
  message = str(e.value)
  assert "optimizer.learning_rate: saved 1e-06, now 2e-06" in message
  assert "sampling.stop_token_ids: saved [2], now [2, 5]" in message
  assert "another directory" in message and "nothing was changed" in message
  assert [d[0] for d in e.value.differences] == ["optimizer.learning_rate",
                                                  "sampling.stop_token_ids"]
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
  # Ignored keys may differ; other runs of the same config resume.
  ignore = ("optimizer.learning_rate", "sampling.stop_token_ids")
  with RunCheckpointer(tmp_path, config=other, config_ignore=ignore) as ckpt:
    assert ckpt.restore(like=_state())[1] == {"data_position": 1}


def test_config_differences_walks_nested_dicts():
  saved = {"ppo": {"lr": 1.0, "ids": [1]}, "path": "a", "lora": None}
  now = {"ppo": {"lr": 2.0, "ids": [1]}, "path": "a", "lora": {"rank": 8}, "new": 1}
  assert config_differences(saved, now) == [
      ("lora", None, "<missing>"), ("lora.rank", "<missing>", 8), ("new", "<missing>", 1),
      ("ppo.lr", 1.0, 2.0),
  ]
  assert config_differences(saved, now, ignore=("ppo", "lora", "new")) == []


def test_unreadable_or_missing_checkpoints_raise_clear_errors(tmp_path):
  with RunCheckpointer(tmp_path / "run", save_every=1) as ckpt:
    for s in (1, 2):
      ckpt.save(s, _state(s), extra={"pos": s})
  with RunCheckpointer(tmp_path / "run") as ckpt:
    with pytest.raises(CheckpointError, match=r"No checkpoint of step 5 .* available steps: "
                                              r"\[1, 2\]"):
      ckpt.restore(5, like=_state())
    with pytest.raises(CheckpointStructureMismatch, match="(?s)step 2 .*w: saved <missing>, "
                                                          "expected float32\\[3\\].*restore "
                                                          "with the setup that wrote it"):
      ckpt.restore(like={"w": jnp.zeros(3)})  # another structure (another model)
  for f in (tmp_path / "run" / "2" / "state").rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  with RunCheckpointer(tmp_path / "run", read_only=True) as ckpt:
    with pytest.raises(CheckpointCorrupt, match=r"(?s)Checkpoint step 2 .* is damaged: .*state: "
                                                r".*Nothing was changed.*restore an earlier "
                                                r"step \(\[1\]\)"):
      ckpt.restore(2, like=_state())
    assert ckpt.steps() == [1, 2]  # nothing deleted
    _assert_same(ckpt.restore(1, like=_state())[0], _state(1))
    with pytest.raises(CheckpointError, match="read-only"):
      ckpt.save(3, _state(3))
  with pytest.raises(CheckpointError, match="No checkpoint directory .*train first"):
    RunCheckpointer(tmp_path / "missing", read_only=True)
  with RunCheckpointer(tmp_path / "empty") as ckpt:
    with pytest.raises(CheckpointError, match="No checkpoint in"):
      ckpt.restore(like=_state())
    with pytest.raises(TypeError, match="JSON-serialisable"):
      ckpt.save(1, _state(), extra={"x": object()})


@pytest.mark.parametrize(
    "kwargs, name",
    [({"save_every": 0}, "save_every"), ({"keep_last": 1.5}, "keep_last"),
     ({"best_mode": "maximum"}, "best_mode"), ({"best_metric": ""}, "best_metric")],
)
def test_invalid_arguments_name_the_argument(tmp_path, kwargs, name):
  with pytest.raises(ValueError, match=f"RunCheckpointer {name}="):
    RunCheckpointer(tmp_path, **kwargs)
  assert not any(tmp_path.iterdir())


def test_best_metric_ignores_non_finite_values(tmp_path):
  with RunCheckpointer(tmp_path, save_every=1, keep_last=1, best_metric="r",
                       async_save=False) as ckpt:
    for s, r in ((1, 1.0), (2, math.inf), (3, -1.0), (4, None)):
      ckpt.save(s, _state(s), {"r": r} if r is not None else {})
    assert ckpt.best_step() == 1 and ckpt.steps() == [1, 4]
