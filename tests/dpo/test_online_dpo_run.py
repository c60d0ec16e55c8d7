"""`jax-ppo dpo` with `prompts_path` (online DPO) end to end on a tiny random Hugging Face
checkpoint built locally: a `module:function` reward scores the sampled pairs, the run resumes,
completes and exports a causal-LM folder that loads back; a reward model works as the scorer;
bad online configs are one line naming the field."""

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.models import from_pretrained  # noqa: E402
from jax_ppo.runs.dpo import DPORunConfig  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, make_reward_checkpoint, write_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

ONLINE = ["dtype=float32", "dpo.batch_size=4", "dpo.total_steps=2", "dpo.sampling.max_new_tokens=6",
          "dpo.optimizer.learning_rate=1e-2", "dpo.optimizer.warmup_steps=0", "run.progress=false",
          "run.tensorboard=false"]
REWARD = "reward_function=tests.tiny_hf_run:score_good_words"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("online_dpo")
  return {"root": root, "model": make_checkpoint(root, "llama"),
          "reward_model": make_reward_checkpoint(root / "rm", "llama"), **write_data(root)}


def _summary(capsys) -> dict:
  out, _ = capsys.readouterr()
  lines = [line for line in out.splitlines() if line.startswith("{")]
  return json.loads(lines[-1]) if lines else {}


@pytest.mark.slow
def test_online_dpo_from_a_prompts_file_trains_resumes_and_exports(assets, tmp_path, capsys):
  run_dir = tmp_path / "run"
  argv = ["dpo", f"model_path={assets['model']}", f"prompts_path={assets['prompts']}", REWARD,
          f"run_dir={run_dir}", "run.steps_per_run=1", *ONLINE]
  assert main(argv) == 0
  summary = _summary(capsys)
  assert summary["online"] and summary["step"] == 1 and not summary["complete"]
  assert summary["train/loss"] == pytest.approx(np.log(2), abs=1e-5) or (
      summary["objective/ties"] == 1.0 and summary["train/loss"] == 0.0)
  assert summary["export_dir"] is None
  assert main(argv) == 0  # resumes, completes and exports
  summary = _summary(capsys)
  assert summary["step"] == 2 and summary["complete"] and summary["steps_run"] == 1
  assert {"objective/scores", "objective/scores_chosen", "objective/ties"} <= summary.keys()
  assert summary["export_dir"] == str(run_dir / "hf_model")
  model = from_pretrained(summary["export_dir"])
  hf = transformers.AutoModelForCausalLM.from_pretrained(summary["export_dir"])
  ids = np.array([[3, 4, 5, 6]], np.int32)
  np.testing.assert_allclose(np.asarray(model(ids, np.ones_like(ids))),
                             hf(__import__("torch").tensor(ids)).logits.detach().numpy(),
                             atol=2e-4)
  logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in logged if "objective/scores" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(r["objective/scores_chosen"] >= r["objective/scores_rejected"] for r in steps)
  saved = (run_dir / "config.yaml").read_text()
  assert "prompts_path:" in saved and "score_good_words" in saved


@pytest.mark.slow
def test_online_dpo_with_a_reward_model_and_lora(assets, tmp_path, capsys):
  assert main(["dpo", f"model_path={assets['model']}", f"prompts_path={assets['prompts']}",
               f"reward_model_path={assets['reward_model']}", f"run_dir={tmp_path / 'run'}",
               "lora.rank=2", "dpo.n_samples=3", *ONLINE]) == 0
  summary = _summary(capsys)
  assert summary["complete"] and summary["online"]
  assert summary["objective/ties"] < 1.0  # a reward model's scores rarely tie
  assert summary["objective/scores_chosen"] > summary["objective/scores"]  # best of 3
  from_pretrained(summary["export_dir"])


def test_bad_online_configs_are_one_line_naming_the_field(assets, tmp_path, capsys):
  base = [f"model_path={assets['model']}", f"run_dir={tmp_path / 'run'}"]
  prompts = f"prompts_path={assets['prompts']}"
  for extra, message in (
      ([], "DPORunConfig needs exactly one of train_path (preference records: offline DPO) and "
           "prompts_path"),
      ([prompts, f"train_path={assets['prefs']}", REWARD], "DPORunConfig needs exactly one of "
                                                           "train_path"),
      ([prompts], "DPORunConfig needs exactly one reward source: reward_model_path"),
      ([prompts, REWARD, f"reward_model_path={assets['reward_model']}"],
       "DPORunConfig needs exactly one reward"),
      ([f"train_path={assets['prefs']}", REWARD],
       "DPORunConfig.reward_function is set with train_path: a reward scores the sampled "
       "responses of online DPO only"),
      ([prompts, REWARD, "dpo.precompute_reference=true"],
       "DPORunConfig.dpo.precompute_reference=True is invalid with prompts_path"),
      ([prompts, REWARD, "dpo.eval_fraction=0.1"],
       "DPORunConfig.dpo.eval_fraction=0.1 is invalid with prompts_path"),
      ([prompts, REWARD, f"eval_path={assets['prefs']}"],
       "DPORunConfig.eval_path="),
      ([prompts, REWARD, "dpo.n_samples=1"], "DPOConfig.n_samples=1 is invalid: use an int >= 2"),
      ([prompts, "reward_function=nosuch"], "RunConfig.reward_function='nosuch' is invalid: "
                                            "unknown reward function"),
      ([prompts, f"reward_model_path={assets['model']}"],
       "DPORunConfig.reward_model_path="),
      ([prompts, REWARD, "dpo.sampling.max_new_tokens=64"],
       "DPORunConfig.dpo.sampling.max_new_tokens"),
  ):
    assert main(["dpo", *base, *ONLINE[1:4], *extra]) == 2, extra
    _, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and message in err, (extra, err)
  config = DPORunConfig(run_dir="r", model_path="m", prompts_path="p.jsonl",
                        reward_function="length")
  assert config.train_path is None and ("DPORunConfig.prompts_path", "p.jsonl") in (
      config.read_paths())
