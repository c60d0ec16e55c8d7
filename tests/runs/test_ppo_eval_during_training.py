"""Evaluation on held-out prompts during `jax-ppo train` (`RunConfig.eval_path`, `eval_every`):
a tiny run with `eval_every=1` over 2 updates (stopped after the first and resumed) logs the
held-out reward (each source's too), KL, length and diversity under `eval/` at steps 1 and 2 of
`metrics.jsonl`, the same metrics `jax-ppo eval` reports for the final checkpoint; its trained
parameters and training metrics equal those of the same run without evaluation. Bad evaluation
fields are refused naming the field, and a bad held-out file before any weights load."""

import json
import pathlib

import jax
import numpy as np
import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
pytest.importorskip("transformers")

from jax_ppo.data.prompts import PromptDataset  # noqa: E402
from jax_ppo.ppo.evaluation import HeldOutEval  # noqa: E402
from jax_ppo.runs import ppo  # noqa: E402
from jax_ppo.runs.ppo_config import RunConfig, load_run_config  # noqa: E402
from tests.tiny_hf_run import PROMPTS, make_checkpoint, write_data  # noqa: E402

EVAL_KEYS = ("eval/score_mean", "eval/score_std", "eval/best_of_n", "eval/kl", "eval/entropy",
             "eval/response_length", "eval/distinct_1", "eval/distinct_2",
             "eval/repetition_rate", "eval/n", "eval/reward/length", "eval/reward/words")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("ppo_eval")
  held_out = root / "held_out.txt"
  held_out.write_text("\n".join(PROMPTS[:3]) + "\n")
  return {"root": root, "model": make_checkpoint(root, "llama"), "held_out": str(held_out),
          **write_data(root)}


def _argv(assets, run_dir, *extra) -> list[str]:
  return [f"policy_path={assets['model']}", f"prompts_path={assets['prompts']}",
          f"run_dir={run_dir}",
          "rewards=[{function: length, name: length}, "
          "{function: 'tests.tiny_hf_run:score_good_words', name: words, weight: 0.5}]",
          "ppo.batch_size=4", "ppo.num_minibatches=1", "ppo.ppo_epochs=1",
          "ppo.sampling.max_new_tokens=4", "ppo.sampling.temperature=1.0", "ppo.total_updates=2",
          "ppo.optimizer.learning_rate=1e-2", "run.progress=false", "run.tensorboard=false",
          "run.plots=false", "run.save_every=1", *extra]


def _metrics(run_dir) -> list[dict]:
  text = (pathlib.Path(run_dir) / "metrics.jsonl").read_text()
  return [json.loads(line) for line in text.splitlines()]


def _params(config) -> list[np.ndarray]:
  """The policy parameters of the latest checkpoint of `config.run_dir`."""
  trainer = ppo.build_trainer(config, open_run=False, prompts=PromptDataset([[0]]))
  trainer.load_checkpoint(config.run_dir)
  return [np.asarray(x) for x in jax.tree.leaves(trainer.state.policy)]


@pytest.fixture(scope="module")
def runs(assets):
  """The run with evaluation (1 update, then resumed to 2) and the same run without."""
  root = assets["root"]
  evaluated = _argv(assets, root / "evaluated", f"eval_path={assets['held_out']}",
                    "eval_every=1", "eval_n=2", "eval_temperature=1.0", "eval_seed=3")
  ppo.run_training(load_run_config([*evaluated, "run.updates_per_run=1"]))
  history = ppo.run_training(load_run_config(evaluated))  # resumes at step 1
  plain = _argv(assets, root / "plain")
  ppo.run_training(load_run_config(plain))
  return load_run_config(evaluated), load_run_config(plain), history


@pytest.mark.slow  # two tiny runs (~1 min with their compilation)
def test_held_out_metrics_are_logged_at_every_step(runs, assets):
  config, _, history = runs
  logged = _metrics(config.run_dir)
  assert [m["step"] for m in logged] == [1, 2]
  for record in logged:
    missing = [k for k in EVAL_KEYS if k not in record]
    assert not missing, (record["step"], missing)
    assert record["eval/n"] == 2.0 and record["time/eval_s"] > 0
    assert 0 < record["eval/distinct_1"] <= 1 and 0 <= record["eval/repetition_rate"] <= 1
    assert record["eval/best_of_n"] >= record["eval/score_mean"]
    # the combined held-out reward is the weighted sum of its sources' means
    assert record["eval/score_mean"] == pytest.approx(
        record["eval/reward/length"] + 0.5 * record["eval/reward/words"], abs=1e-5)
  assert history[-1]["eval/kl"] == logged[-1]["eval/kl"]  # (also in the returned history)
  # The metrics of step 2 are those `jax-ppo eval` reports for the final checkpoint.
  result = ppo.evaluate_run(config.run_dir, assets["held_out"], temperature=1.0, n=2, seed=3,
                            out=assets["root"] / "eval.json")
  assert result["step"] == 2
  for key, value in result["metrics"].items():
    assert logged[-1][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


@pytest.mark.slow  # two tiny runs (~1 min with their compilation)
def test_evaluation_does_not_change_training(runs):
  evaluated, plain, _ = runs
  for a, b in zip(_params(evaluated), _params(plain), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(_metrics(evaluated.run_dir), _metrics(plain.run_dir), strict=True):
    assert not any(k.startswith("eval/") for k in b)
    for key in ("objective/scores", "objective/kl", "loss/total_avg", "reward/length",
                "rollout/response_length"):
      assert a[key] == b[key], key


def test_the_schedule_evaluates_every_n_updates_and_the_last():
  prompts = [[3, 4]]
  assert [s for s in range(1, 6) if HeldOutEval(prompts=prompts, every=2).due(s, 5)] == [2, 4, 5]
  assert [s for s in range(1, 6) if HeldOutEval(prompts=prompts).due(s, 5)] == [5]
  with pytest.raises(ValueError, match=r"^HeldOutEval.prompts is empty"):
    HeldOutEval(prompts=[])


@pytest.mark.parametrize("extra, message", [
    (["eval_every=2"], "RunConfig.eval_every=2 sets the evaluation on held-out prompts, but "
                       "RunConfig.eval_path is null; give eval_path"),
    (["eval_n=4", "eval_temperature=1.0"], "RunConfig.eval_n=4 sets the evaluation"),
    (["eval_path=HELD", "eval_every=-1"], "RunConfig.eval_every=-1 is invalid: use an int >= 0"),
    (["eval_path=HELD", "eval_n=0"], "RunConfig.eval_n=0 is invalid: give the number of samples"),
    (["eval_path=HELD", "eval_n=3"], "RunConfig.eval_n=3 needs sampling: greedy decoding gives "
                                     "3 identical responses; give RunConfig.eval_temperature"),
    (["eval_path=HELD", "eval_temperature=0"], "RunConfig.eval_temperature=0.0 is invalid: give a "
                                               "temperature > 0, or null"),
    (["eval_path=HELD", "eval_seed=-2"], "RunConfig.eval_seed=-2 is invalid"),
])
def test_bad_eval_fields_are_refused_naming_the_field(assets, tmp_path, extra, message):
  extra = [e.replace("HELD", assets["held_out"]) for e in extra]
  with pytest.raises(ValueError) as error:
    load_run_config(_argv(assets, tmp_path / "run", *extra))
  assert str(error.value).startswith(message), str(error.value)
  with pytest.raises(ValueError, match=r"^RunConfig.eval_path='' is invalid: give a held-out "):
    RunConfig(policy_path=assets["model"], prompts_path=assets["prompts"],
              reward_function="length", run_dir=str(tmp_path / "run"), eval_path="")


def test_a_bad_held_out_file_is_refused_before_any_weights_load(assets, tmp_path, no_weights):
  run_dir = tmp_path / "run"
  with pytest.raises(FileNotFoundError, match="RunConfig.eval_path"):
    ppo.run_training(load_run_config(_argv(assets, run_dir,
                                           f"eval_path={tmp_path / 'missing.jsonl'}")))
  bad = tmp_path / "held_out.jsonl"
  bad.write_text('{"prompt": "the movie was"}\n{"text": "no prompt"}\n')
  with pytest.raises(ValueError, match=rf"RunConfig.eval_path.*{bad.name}.*line 2"):
    ppo.run_training(load_run_config(_argv(assets, run_dir, f"eval_path={bad}")))
  long = tmp_path / "long.txt"  # the context is 64 tokens, 4 of them for the response
  long.write_text("the movie was\n" + " ".join(["good"] * 70) + "\n")
  with pytest.raises(ValueError, match=rf"RunConfig.eval_path.*{long.name}.*line 2"):
    ppo.run_training(load_run_config(_argv(assets, run_dir, f"eval_path={long}")))
  assert not run_dir.exists()
  # The run folder must not overlap the held-out file.
  with pytest.raises(ValueError, match=r"RunConfig.run_dir=.* RunConfig.eval_path="):
    load_run_config(_argv(assets, tmp_path, f"eval_path={long}"))
