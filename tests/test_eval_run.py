"""What a run reports (issue 10 item 8): distinct-n, repetition rate and best-of-n against hand
counts; end to end, a run logs the hyperparameter guide's advice at its start, logs to W&B when
`wandb=true` (a fake `wandb` module, never the network), writes PNG plots at the end of train,
and `jax-ppo eval --n N` reports mean and best-of-n reward, KL, distinct-n, response length and
repetition rate into its JSON output."""

from __future__ import annotations

import json
import logging
import sys
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.cli import main
from jax_ppo.ppo.eval_metrics import best_of_n, distinct_n, repetition_rate
from jax_ppo.runs import ppo as run
from jax_ppo.runs import ppo_config as run_config
from tests.test_bad_inputs import PROMPTS, files  # noqa: F401 - fixture

# ---- the metrics, by hand ------------------------------------------------------------------------


def test_distinct_n_against_a_hand_count():
  responses = ["the cat sat", "the cat ran", "a dog"]
  # unigrams: the cat sat the cat ran a dog -> 8 in all, {the, cat, sat, ran, a, dog} 6 unique
  assert distinct_n(responses, 1) == pytest.approx(6 / 8)
  # bigrams: (the cat) (cat sat) (the cat) (cat ran) (a dog) -> 5 in all, 4 unique
  assert distinct_n(responses, 2) == pytest.approx(4 / 5)
  assert distinct_n(["good good good good"], 1) == pytest.approx(1 / 4)
  assert distinct_n([[5, 6, 5], [6, 5]], 2) == pytest.approx(2 / 3)  # token ids: (5,6)(6,5)(6,5)
  assert distinct_n(["one", ""], 2) == 0.0  # no bigram at all
  with pytest.raises(ValueError, match="n=0 is invalid"):
    distinct_n(responses, 0)


def test_repetition_rate_against_a_hand_count():
  # "great great great great": bigrams (great great) x3, 1 unique -> 1 - 1/3; "a b c": 0.
  assert repetition_rate(["great great great great", "a b c"]) == pytest.approx((2 / 3 + 0) / 2)
  assert repetition_rate(["a b a b"], 1) == pytest.approx(0.5)
  assert repetition_rate(["single"]) == 0.0  # no bigram: not counted


def test_best_of_n_by_hand_and_its_errors():
  scores = [1.0, 3.0, 2.0,  # prompt 0: best 3
            -1.0, -2.0, 0.5]  # prompt 1: best 0.5
  assert best_of_n(scores, 3) == pytest.approx((3.0 + 0.5) / 2)
  assert best_of_n(scores, 1) == pytest.approx(np.mean(scores))
  with pytest.raises(ValueError, match="are not n=4 samples per prompt"):
    best_of_n(scores, 4)


@given(st.integers(1, 5), st.integers(1, 6), st.data())
def test_best_of_n_is_at_least_the_mean(n, prompts, data):
  scores = data.draw(st.lists(st.floats(-1e6, 1e6), min_size=n * prompts, max_size=n * prompts))
  assert best_of_n(scores, n) >= np.mean(scores) - 1e-6 * (1 + np.abs(scores).max())


# ---- a run end to end ----------------------------------------------------------------------------


class _FakeWandb(types.ModuleType):
  """A stand-in `wandb` module recording `init`, `define_metric`, `log` and `finish` (no
  network)."""

  def __init__(self):
    super().__init__("wandb")
    self.inits, self.defined, self.logged, self.finished = [], [], [], 0
    module = self

    class Run:
      id = "fake-run"

      def define_metric(self, name, **kwargs):
        module.defined.append((name, kwargs))

      def log(self, data, step=None):
        module.logged.append((step, dict(data)))

      def finish(self):
        module.finished += 1

    self._run = Run()

  def init(self, **kwargs):
    self.inits.append(kwargs)
    return self._run


@pytest.fixture(scope="module")
def trained(files, tmp_path_factory):  # noqa: F811
  """One PPO update with W&B on (fake module) and the guide's advice captured."""
  run_dir = tmp_path_factory.mktemp("eval_run") / "run"
  fake = _FakeWandb()
  records: list[logging.LogRecord] = []
  handler = logging.Handler()
  handler.emit = records.append
  run_logger = logging.getLogger("jax_ppo.run")
  run_logger.addHandler(handler)
  saved = sys.modules.get("wandb")
  sys.modules["wandb"] = fake
  try:
    history = run.run_training(run_config.load_run_config([
        str(files / "run.yaml"), f"run_dir={run_dir}", "run.updates_per_run=1", "run.wandb=true",
        "run.wandb_init={project: test-project}",
    ]))
  finally:
    run_logger.removeHandler(handler)
    if saved is None:
      sys.modules.pop("wandb", None)
    else:
      sys.modules["wandb"] = saved
  return run_dir, history, fake, [r.getMessage() for r in records]


@pytest.mark.slow  # shares one training run (~1 min with its compilation)
def test_the_guide_advice_is_logged_at_the_start_of_a_run(trained):
  _, _, _, messages = trained
  advice = run.check_against_guide(run_config.saved_run_config(trained[0]).ppo)
  assert advice and any("learning_rate=0.001 is above the recommended" in a for a in advice)
  for line in advice:
    assert f"Hyperparameter guide: {line}" in messages
  assert messages.index(f"Hyperparameter guide: {advice[0]}") == 0  # before anything else


@pytest.mark.slow  # shares one training run (~1 min with its compilation)
def test_wandb_is_switched_on_from_the_run_config(trained):
  run_dir, history, fake, _ = trained
  assert len(fake.inits) == 1 and fake.finished == 1
  init = fake.inits[0]
  assert init["project"] == "test-project" and init["dir"] == str(run_dir)
  assert init["config"]["run"]["wandb"] is True and init["config"]["run_dir"] == str(run_dir)
  # the step is a metric, W&B's x-axis of every other one (so a resume's repeated steps are kept)
  assert fake.defined == [("step", {}), ("*", {"step_metric": "step"})]
  assert [(step, data["step"]) for step, data in fake.logged] == [(None, 1)]
  assert (run_dir / "wandb_run_id").read_text() == "fake-run\n"
  assert fake.logged[0][1]["objective/kl"] == pytest.approx(history[0]["objective/kl"])


@pytest.mark.slow  # shares one training run (~1 min with its compilation)
def test_plots_are_written_at_the_end_of_train(trained):
  pytest.importorskip("matplotlib")
  run_dir = trained[0]
  names = sorted(p.name for p in (run_dir / "plots").iterdir())
  # PPO's panels with data (jax_ppo.logging.plots.PANELS["ppo"]: KL and entropy per response and
  # per token apart) and the overview of them all
  assert {"overview.png", "reward.png", "kl_per_response.png", "kl_per_token.png",
          "entropy_per_token.png", "entropy_per_response.png", "response_length.png",
          "policy_loss.png", "learning_rate.png"} <= set(names)
  for name in names:
    assert (run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # shares one training run (~1 min with its compilation)
def test_eval_reports_best_of_n_kl_distinct_n_and_length(trained, tmp_path, capsys):
  run_dir = trained[0]
  prompts = tmp_path / "heldout.txt"
  prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
  out = tmp_path / "eval.json"
  assert main(["eval", "--run-dir", str(run_dir), "--prompts", str(prompts), "--temperature",
               "1.0", "--n", "4", "--out", str(out)]) == 0
  printed = json.loads(capsys.readouterr().out)
  result = json.loads(out.read_text())
  metrics = result["metrics"]
  assert result["n"] == 4 and len(result["samples"]) == 12
  assert [s["prompt_index"] for s in result["samples"]] == [i // 4 for i in range(12)]
  scores = [s["reward"] for s in result["samples"]]
  assert metrics["eval/score_mean"] == pytest.approx(np.mean(scores))
  assert metrics["eval/best_of_n"] == pytest.approx(best_of_n(scores, 4))
  assert metrics["eval/best_of_n"] >= metrics["eval/score_mean"]
  responses = [s["response"] for s in result["samples"]]
  assert metrics["eval/distinct_1"] == pytest.approx(distinct_n(responses, 1))
  assert metrics["eval/distinct_2"] == pytest.approx(distinct_n(responses, 2))
  assert metrics["eval/repetition_rate"] == pytest.approx(repetition_rate(responses))
  assert metrics["eval/kl"] == pytest.approx(np.mean([s["kl"] for s in result["samples"]]))
  assert metrics["eval/response_length"] == pytest.approx(
      np.mean([s["length"] for s in result["samples"]]))
  assert {k: printed[k] for k in metrics} == metrics
  # The built-in `length` reward: every sample's score is its length, so best-of-n is the mean
  # of each prompt's longest sample.
  lengths = np.array([s["length"] for s in result["samples"]]).reshape(3, 4)
  assert metrics["eval/best_of_n"] == pytest.approx(lengths.max(1).mean())


@pytest.mark.slow  # shares one training run (~1 min with its compilation)
def test_eval_refuses_best_of_n_when_greedy(trained, tmp_path, capsys):
  prompts = tmp_path / "heldout.txt"
  prompts.write_text(PROMPTS[0] + "\n")
  assert main(["eval", "--run-dir", str(trained[0]), "--prompts", str(prompts), "--n", "3"]) == 2
  assert "--n=3 needs sampling" in capsys.readouterr().err
