"""The quickstart pipeline: configuration checks, the report, and a shortened end-to-end run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_ppo.quickstart import QuickstartConfig, report, run_quickstart, smoke, stages
from jax_ppo.quickstart.stages import read_jsonl, write_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("field", "value", "match"), [
    ("eval_samples", 32, "eval_samples=32 is invalid: use at least 64"),
    ("num_kv_heads", 3, "num_kv_heads=3 is invalid"),
    ("ppo_batch_size", 31, "divisible by ppo_minibatches"),
    ("model_type", "gpt2", "model_type='gpt2' is invalid"),
    ("kl_coef", -1.0, "kl_coef=-1.0 is invalid"),
    ("hack_pair_fraction", 1.5, "hack_pair_fraction=1.5 is invalid"),
])
def test_config_errors_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    QuickstartConfig(**{field: value})


def test_report_table_and_verdict_use_the_measured_records(tmp_path):
  before = {"stage": "ppo", "step": 0, "gold/gold_score": -0.1, "eval/score_mean": 0.0,
            "eval/kl": 0.0, "gold/distinct_2": 0.5, "gold/repetition_rate": 0.02,
            "gold/length_words": 12.0, "eval/response_length": 18.0, "gold/score_std": 0.64,
            "eval/samples": 64.0}
  after = {**before, "step": 40, "gold/gold_score": 0.7, "eval/kl": 3.5}
  table = report.before_after_table(before, after)
  assert "SFT (step 0)" in table and "PPO (step 40)" in table
  gold_row = next(line for line in table.splitlines() if line.startswith("gold score"))
  assert gold_row.split()[-3:] == ["-0.100", "+0.700", "+0.800"]
  lines = report.verdict(before, after)
  assert "(+0.800; 10.0 standard errors" in lines[0]
  write_jsonl(tmp_path / "metrics.jsonl", [after, {"stage": "sft", "step": 3}, before])
  assert [r["step"] for r in report.ppo_evaluations(tmp_path)] == [0, 40]


def test_a_different_configuration_is_refused(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({**vars(smoke()), "sft_steps": 99}))
  with pytest.raises(ValueError, match=r"sft_steps: 99 -> 6.*same flags"):
    run_quickstart(smoke(), tmp_path, progress=False, log=lambda s: None)


@pytest.mark.slow
def test_smoke_run_end_to_end_and_resume(tmp_path):
  out = tmp_path / "qs"
  env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  cmd = [sys.executable, str(ROOT / "experiments" / "quickstart.py"), "--smoke",
         "--no-progress", "--out", str(out)]
  first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "Before/after PPO" in first.stdout and "gold score" in first.stdout
  for path in ("config.json", "metrics.jsonl", "samples.jsonl", "summary.json",
               "data/tokenizer/tokenizer.json", "sft/hf/config.json", "sft/metrics.jsonl",
               "pairs/train.jsonl", "reward_model/hf/config.json",
               "reward_model/hf/reward_normalisation.json", "ppo/hf/config.json",
               "ppo/metrics.jsonl", "plots/sft_loss.png", "plots/rm_accuracy.png",
               "plots/ppo_reward.png", "plots/ppo_kl.png", "plots/ppo_entropy.png",
               "plots/ppo_response_length.png", "plots/ppo_reward_kl.png", "plots/overview.png"):
    assert (out / path).exists(), path
  assert list((out / "ppo" / "checkpoints").iterdir())
  samples = [r for r in read_jsonl(out / "samples.jsonl") if r["stage"] == "ppo"]
  cfg = smoke()
  for step in range(cfg.ppo_updates + 1):  # step 0 (before any update) and every evaluation
    at_step = [r for r in samples if r["step"] == step]
    assert len(at_step) >= 64
    assert set(at_step[0]) >= {"stage", "step", "prompt", "response", "reward"}
  summary = json.loads((out / "summary.json").read_text())
  assert summary["before"]["step"] == 0 and summary["after"]["step"] == cfg.ppo_updates
  assert summary["before"]["eval/kl"] == pytest.approx(0.0, abs=1e-5)
  assert summary["table"] in first.stdout

  # The same command again: every stage is done, nothing is retrained or duplicated.
  second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "skipped, already done: data, sft, pairs, reward_model, ppo" in second.stdout
  assert summary["table"] in second.stdout
  assert len([r for r in read_jsonl(out / "samples.jsonl") if r["stage"] == "ppo"]) == len(
      samples)


def test_redone_stages_do_not_duplicate_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  write_jsonl(path, [{"stage": "sft", "step": 6, "a": 1}, {"stage": "ppo", "step": 0},
                     {"stage": "ppo", "step": 1}, {"stage": "ppo", "step": 2}])
  stages.replace_stage_records(path, "sft", [{"stage": "sft", "step": 6, "a": 2}])
  assert [r for r in read_jsonl(path) if r["stage"] == "sft"] == [
      {"stage": "sft", "step": 6, "a": 2}]
  write_jsonl(tmp_path / "samples.jsonl",
              [{"stage": "ppo", "step": 2}, {"stage": "sft", "step": 9}])
  stages._truncate_ppo_records(tmp_path, 1)  # a PPO run resumed from step 1 redoes step 2
  assert [(r["stage"], r["step"]) for r in read_jsonl(path)] == [
      ("ppo", 0), ("ppo", 1), ("sft", 6)]
  assert read_jsonl(tmp_path / "samples.jsonl") == [{"stage": "sft", "step": 9}]


def test_script_flag_errors_name_the_field(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  result = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "quickstart.py"), "--smoke", "--eval-samples",
       "10", "--out", str(tmp_path / "qs")], capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 2
  assert "QuickstartConfig.eval_samples=10 is invalid: use at least 64" in result.stderr
  assert not (tmp_path / "qs").exists()
