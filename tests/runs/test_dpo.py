"""`jax-ppo dpo` (jax_ppo.runs.dpo) end to end on a tiny random Hugging Face checkpoint built
locally: preference files in text and in chat form train and export a causal-LM folder that
loads back (with jax_ppo and transformers); `jax-ppo config dpo` prints a config that loads; bad
inputs are one line naming the field; the export never overwrites an input."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.models import from_pretrained  # noqa: E402
from jax_ppo.runs.dpo import DPORunConfig, load_dpo_config  # noqa: E402
from jax_ppo.runs.templates import config_template  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, write_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

DPO = ["dtype=float32", "dpo.max_length=16", "dpo.batch_size=4", "dpo.total_steps=2",
       "dpo.optimizer.learning_rate=1e-2", "dpo.optimizer.warmup_steps=0", "run.progress=false",
       "run.tensorboard=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("dpo")
  model = make_checkpoint(root, "llama")
  chat = root / "chat_model"
  shutil.copytree(model, chat)
  tok = transformers.AutoTokenizer.from_pretrained(chat)
  tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
  tok.save_pretrained(chat)
  return {"root": root, "model": model, "chat_model": str(chat), **write_data(root)}


def _summary(capsys) -> tuple[dict, str]:
  out, err = capsys.readouterr()
  lines = [line for line in out.splitlines() if line.startswith("{")]
  return (json.loads(lines[-1]) if lines else {}), err


def _check_export(path, start):
  """The export loads back with jax_ppo and transformers, and its weights left the start's."""
  model = from_pretrained(path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path)
  ids = np.array([[3, 4, 5, 6]], np.int32)
  ours = np.asarray(model(ids, np.ones_like(ids)))
  theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.detach().numpy()
  np.testing.assert_allclose(ours, theirs, atol=2e-4)
  before = transformers.AutoModelForCausalLM.from_pretrained(start)
  old, new = before.state_dict(), hf.state_dict()
  assert old.keys() == new.keys()
  assert any(not torch.allclose(old[k], new[k]) for k in old)


@pytest.mark.slow
def test_dpo_from_a_text_preference_file_trains_resumes_and_exports(assets, tmp_path, capsys):
  run_dir = tmp_path / "run"
  argv = ["dpo", f"model_path={assets['model']}", f"train_path={assets['prefs']}",
          f"run_dir={run_dir}", "dpo.eval_fraction=0.25", "run.steps_per_run=1", *DPO]
  assert main(argv) == 0
  summary, _ = _summary(capsys)
  assert summary["stage"] == "dpo" and summary["step"] == 1 and not summary["complete"]
  assert summary["train/loss"] == pytest.approx(np.log(2), abs=1e-5)
  assert summary["export_dir"] is None
  assert main(argv) == 0  # resumes, completes and exports
  summary, _ = _summary(capsys)
  assert summary["step"] == 2 and summary["complete"] and summary["steps_run"] == 1
  assert {"eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"} <= summary.keys()
  assert summary["export_dir"] == str(run_dir / "hf_model")
  _check_export(summary["export_dir"], assets["model"])
  logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged if "rewards/margins" in r] == [1, 2]


@pytest.mark.slow
def test_dpo_from_a_chat_preference_file_with_lora(assets, tmp_path, capsys):
  turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
  users = [[turn("user", "the movie was")], [turn("user", "the plot is")]]
  records = [{"chosen": u + [turn("assistant", "good fun")],  # implicit prompt
              "rejected": u + [turn("assistant", "dull")]} for u in users * 2]
  records.append({"prompt": users[0], "chosen": [turn("assistant", "very good")],
                  "rejected": [turn("assistant", "bad")]})  # explicit prompt
  path = tmp_path / "chats.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  export = tmp_path / "out"
  assert main(["dpo", f"model_path={assets['chat_model']}", f"train_path={path}",
               f"run_dir={tmp_path / 'run'}", f"export_dir={export}", "lora.rank=2",
               "dpo.precompute_reference=true", *DPO]) == 0
  summary, _ = _summary(capsys)
  assert summary["complete"] and summary["export_dir"] == str(export)
  assert summary["time/reference_s"] > 0  # the base's log-probs were computed once
  assert summary["train/loss"] < np.log(2)  # the second step sees the first's progress
  _check_export(export, assets["chat_model"])


def test_config_template_bad_inputs_and_paths(assets, tmp_path, capsys):
  text = config_template("dpo")
  assert "dpo:" in text and "beta: 0.1" in text and "loss_type: sigmoid" in text
  assert "reference_path: null" in text
  written = tmp_path / "dpo.yaml"
  written.write_text(text)
  config = load_dpo_config([str(written), "run_dir=r", "model_path=m", "train_path=t.jsonl"])
  assert config == DPORunConfig(run_dir="r", model_path="m", train_path="t.jsonl")
  base = [f"model_path={assets['model']}", f"train_path={assets['prefs']}",
          f"run_dir={tmp_path / 'run'}"]
  for extra, message in (
      (["dpo.beta=0"], "DPOConfig.beta=0.0 is invalid: use a finite value > 0"),
      (["dpo.loss_type=kto"], "DPOConfig.loss_type='kto' is invalid: use one of"),
      (["dpo.label_smoothing=0.5"], "DPOConfig.label_smoothing=0.5 is invalid"),
      ([f"reference_path={assets['model']}", "lora.rank=2"],
       "DPORunConfig.reference_path is set with lora"),
      ([f"export_dir={assets['root']}"], "DPORunConfig.export_dir="),
  ):
    assert main(["dpo", *base, *extra]) == 2
    _, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and message in err, err
  assert main(["config", "dpo"]) == 0
  assert "jax-ppo dpo dpo.yaml" in capsys.readouterr().out
