"""Several reward sources combined with weights (issue 10 item 7): `CombinedScorer` applies the
weights to each source's raw score, logs each source as `reward/<name>`, checks every source like
a single one and names the source in its errors; `RunConfig.rewards` configures it from the
config file and the command line."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_ppo.cli import main
from jax_ppo.rewards import specs
from jax_ppo.rewards.scorers import CombinedScorer, FunctionScorer, RewardFunctionError, TokenScorer
from jax_ppo.runs import ppo as run
from jax_ppo.runs import ppo_config as run_config
from tests.rewards.test_reward_sources import RESPONSES, _rollout
from tests.test_bad_inputs import files, user_rewards  # noqa: F401 - fixtures


def _lengths(prompts, responses):
  return [float(len(r)) for r in responses]


def _first_token(prompts, responses):
  return [float(r[0]) for r in responses]


def test_weights_are_applied_and_each_source_is_logged():
  count_13 = TokenScorer(lambda p, pm, r, rm: jnp.sum((r == 13) & rm, axis=1).astype(jnp.float32),
                         name="count13")
  scorer = CombinedScorer([("len", FunctionScorer(_lengths), 0.5),
                           ("first", FunctionScorer(_first_token), -2.0),
                           ("c13", count_13, 3.0)])
  scores = np.asarray(scorer(_rollout()))
  lengths = np.array([len(r) for r in RESPONSES], np.float32)
  first = np.array([r[0] for r in RESPONSES], np.float32)
  c13 = np.array([r.count(13) for r in RESPONSES], np.float32)
  np.testing.assert_allclose(scores, 0.5 * lengths - 2.0 * first + 3.0 * c13, rtol=1e-6)
  metrics = scorer.metrics()
  assert metrics["reward/len"] == pytest.approx(lengths.mean())
  assert metrics["reward/first"] == pytest.approx(first.mean())
  assert metrics["reward/c13"] == pytest.approx(c13.mean())
  assert metrics["reward/first_std"] == pytest.approx(first.std())
  assert scorer.state is None  # no reward model: nothing for FrozenParams.reward


def test_a_bad_source_is_named_with_its_weight():
  bad = FunctionScorer(lambda p, r: [1.0, math.nan, 0.0, 0.0], name="mod:nan")
  scorer = CombinedScorer([("len", FunctionScorer(_lengths), 1.0), ("nanny", bad, 0.25)])
  with pytest.raises(ValueError, match=r"^Reward source 'nanny' \(weight 0.25\): The reward "
                                       r"function 'mod:nan' returned non-finite scores at rows "
                                       r"\[1\]"):
    scorer(_rollout())

  def boom(prompts, responses):
    raise KeyError("x")

  scorer = CombinedScorer([("boom", FunctionScorer(boom), 1.0)])
  with pytest.raises(RewardFunctionError, match=r"^Reward source 'boom' \(weight 1\): .*raised "
                                                r"KeyError") as info:
    scorer(_rollout())
  assert isinstance(info.value.__cause__, RewardFunctionError)
  assert isinstance(info.value.__cause__.__cause__, KeyError)


@pytest.mark.parametrize("sources, message", [
    ([], "at least one"),
    ([("a", FunctionScorer(_lengths), 1.0), ("a", FunctionScorer(_lengths), 2.0)],
     "two reward sources are named 'a'"),
    ([("a", FunctionScorer(_lengths), math.inf)], "'a' has weight inf"),
    ([("a", "not a scorer", 1.0)], "'a' is 'not a scorer', not a scorer"),
])
def test_combined_scorer_refuses_bad_sources(sources, message):
  with pytest.raises(ValueError, match=message):
    CombinedScorer(sources)


def _config(**kw):
  return run_config.RunConfig(policy_path="p", prompts_path="x.txt", run_dir="r", **kw)


def test_run_config_rewards_and_their_errors():
  config = _config(rewards=(specs.RewardSource(function="length", weight=0.5),
                            specs.RewardSource(model_path="rm"),
                            specs.RewardSource(model_path="rm2", name="safety")))
  assert specs.reward_source_names(config.rewards) == ["length", "reward_model", "safety"]
  with pytest.raises(ValueError, match="exactly one reward source: reward_model_path"):
    _config(reward_function="length", rewards=(specs.RewardSource(function="length"),))
  with pytest.raises(ValueError, match="exactly one of function"):
    specs.RewardSource(function="length", model_path="rm")
  with pytest.raises(ValueError, match="unknown reward function 'lenght'"):
    specs.RewardSource(function="lenght")
  with pytest.raises(ValueError, match=r"RewardSource.weight=nan is invalid"):
    specs.RewardSource(function="length", weight=float("nan"))
  with pytest.raises(ValueError, match=r"rewards\[1\]: the name 'length' is used twice"):
    _config(rewards=(specs.RewardSource(function="length"),
                     specs.RewardSource(function="length", weight=2.0)))


def test_rewards_from_the_command_line(files):  # noqa: F811
  config = run_config.load_run_config([
      str(files / "run.yaml"), "reward_function=null",
      "rewards=[{function: length, weight: 2.0}, {model_path: rm, weight: 0.5, name: rm}]",
  ])
  assert config.rewards == (specs.RewardSource(function="length", weight=2.0),
                            specs.RewardSource(model_path="rm", weight=0.5, name="rm"))
  with pytest.raises(ValueError, match=r"'rewards\.0\.functoin'.*Did you mean 'function'"):
    run_config.load_run_config([str(files / "run.yaml"), "reward_function=null",
                         "rewards=[{functoin: length}]"])


def test_a_missing_reward_model_folder_is_named(files, tmp_path, capsys):  # noqa: F811
  status = main(["train", str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}",
                 "reward_function=null",
                 f"rewards=[{{function: length}}, {{model_path: {tmp_path / 'nope'}}}]"])
  err = capsys.readouterr().err
  assert status == 2 and "RunConfig.rewards[1].model_path=" in err and "nope" in err, err


@pytest.mark.slow
def test_a_reward_model_and_functions_train_end_to_end(files, tmp_path, user_rewards):  # noqa: F811
  run_dir = tmp_path / "run"
  history = run.run_training(run_config.load_run_config([
      str(files / "run.yaml"), f"run_dir={run_dir}", "reward_function=null",
      "run.updates_per_run=1",
      f"rewards=[{{model_path: {files / 'reward'}, weight: 0.5}}, {{function: length, weight: "
      f"2.0}}, {{function: '{user_rewards}:words', weight: -1.0, name: words}}]",
  ]))
  logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
  for name in ("reward_model", "length", "words"):
    assert f"reward/{name}" in logged and f"reward/{name}" in history[0]
  combined = (0.5 * logged["reward/reward_model"] + 2.0 * logged["reward/length"]
              - logged["reward/words"])
  assert logged["objective/scores"] == pytest.approx(combined, rel=1e-4, abs=1e-4)
  # Evaluation reports each source too, and their weighted sum is every sample's reward.
  (tmp_path / "heldout.txt").write_text("the movie was\nthe actor is\n")
  result = run.evaluate_run(run_dir, tmp_path / "heldout.txt", temperature=1.0, n=2)
  metrics = result["metrics"]
  for sample in result["samples"]:
    parts = sample["rewards"]
    assert sample["reward"] == pytest.approx(
        0.5 * parts["reward_model"] + 2.0 * parts["length"] - parts["words"], abs=1e-4)
    assert parts["length"] == sample["length"]
  assert metrics["eval/score_mean"] == pytest.approx(
      0.5 * metrics["eval/reward/reward_model"] + 2.0 * metrics["eval/reward/length"]
      - metrics["eval/reward/words"], abs=1e-4)
  assert [r["name"] for r in result["reward"]] == ["reward_model", "length", "words"]
