"""PNG plots of a run folder's metrics: `write_plots` recognises the stage from the metric names
of its `metrics.jsonl` (the key sets below are those each stage's trainer logs) and writes one
valid PNG per panel with data plus `overview.png`; `jax-ppo plot RUN_DIR` does the same."""

from __future__ import annotations

import json

import pytest

from jax_ppo.cli import main
from jax_ppo.logging.plots import OVERVIEW_FILE, PANELS, detect_stage, read_metrics, write_plots

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The metric names each stage's trainer writes into metrics.jsonl (as of this commit).
PPO_KEYS = (
    "advantages/mean", "advantages/std", "entropy_coef", "episode", "eps", "kl_coef",
    "loss/policy_avg", "loss/total_avg", "loss/value_avg", "lr", "lr/critic", "mfu",
    "objective/entropy", "objective/kl", "objective/non_score_reward", "objective/raw_scores",
    "objective/rlhf_reward", "objective/scores", "objective/scores_std", "policy/approxkl_avg",
    "policy/clipfrac_avg", "policy/dual_clipfrac_avg", "policy/early_stopped",
    "policy/entropy_avg", "policy/epochs_run", "policy/grad_norm", "response_length/mean",
    "response_length/std", "rollout/logprob_mismatch", "rollout/prompt_len",
    "rollout/response_length", "rollout_correction/kl", "skipped_updates", "time/rollout_s",
    "time/score_s", "time/total_s", "time/update_s", "tokens_per_s", "val/clipfrac_avg",
    "val/explained_variance", "val/mean", "val/num_eos_tokens", "val/ratio",
    "val/ratio_first_minibatch", "val/ratio_var", "reward/length", "reward/length_std")
PPO_EVAL_KEYS = ("eval/score_mean", "eval/score_std", "eval/response_length", "eval/kl",
                 "eval/entropy")
SFT_KEYS = ("lr", "skipped_updates", "train/grad_norm", "train/loss", "train/perplexity",
            "train/tokens")
SFT_EVAL_KEYS = ("eval/loss", "eval/perplexity", "eval/tokens")
RM_KEYS = ("lr", "skipped_updates", "train/accuracy", "train/chosen", "train/grad_norm",
           "train/loss", "train/margin", "train/rejected")
RM_EVAL_KEYS = ("eval/accuracy", "eval/loss", "eval/pairs")
DPO_KEYS = ("logps/chosen", "logps/rejected", "lr", "rewards/accuracies", "rewards/chosen",
            "rewards/margins", "rewards/rejected", "skipped_updates", "train/grad_norm",
            "train/loss")
DPO_EVAL_KEYS = ("eval/loss", "eval/rewards/chosen", "eval/rewards/rejected",
                 "eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen",
                 "eval/logps/rejected", "eval/pairs")


def _check_png(path):
  from PIL import Image

  data = path.read_bytes()
  assert data[:8] == PNG_SIGNATURE
  with Image.open(path) as image:
    image.verify()  # raises on a truncated or corrupt file
  with Image.open(path) as image:
    assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def _write(run_dir, records):
  run_dir.mkdir(parents=True, exist_ok=True)
  lines = [json.dumps(r) for r in records]
  (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 9, \"objective/sc")


def _stage_records(keys, eval_keys, steps=12, eval_every=4):
  """Training rows with every key of a stage (positive, changing values) and evaluation rows."""
  records = [{"step": s, **{k: 1.0 + 0.1 * s + 0.01 * i for i, k in enumerate(keys)}}
             for s in range(1, steps + 1)]
  records += [{"step": s, **{k: 2.0 - 0.05 * s for k in eval_keys}}
              for s in range(0, steps + 1, eval_every)]
  return records


@pytest.mark.parametrize(("stage", "keys", "eval_keys", "expected"), [
    ("ppo", PPO_KEYS, PPO_EVAL_KEYS,
     ["approx_kl", "clip_fraction", "entropy_per_response", "entropy_per_token",
      "explained_variance", "grad_norm", "kl_per_response", "kl_per_token", "learning_rate",
      "policy_loss", "response_length", "reward", "value_loss"]),
    ("sft", SFT_KEYS, SFT_EVAL_KEYS, ["grad_norm", "learning_rate", "loss", "perplexity"]),
    ("reward_model", RM_KEYS, RM_EVAL_KEYS,
     ["accuracy", "grad_norm", "learning_rate", "loss", "margin", "scores"]),
    ("dpo", DPO_KEYS, DPO_EVAL_KEYS,
     ["accuracy", "grad_norm", "learning_rate", "logps", "loss", "margin", "rewards"]),
])
def test_each_stage_gets_its_panels_as_pngs(tmp_path, stage, keys, eval_keys, expected):
  _write(tmp_path / stage, _stage_records(keys, eval_keys))
  assert detect_stage([*keys, *eval_keys]) == stage
  paths = write_plots(tmp_path / stage)
  assert sorted(p.stem for p in paths) == sorted([*expected, "overview"])
  assert paths[-1].name == OVERVIEW_FILE
  assert set(expected) <= set(PANELS[stage])
  for path in paths:
    assert path.parent == tmp_path / stage / "plots"
    _check_png(path)


def test_the_stage_can_be_named_and_unknown_metrics_give_no_plots(tmp_path):
  # A reward-model run whose first rows have only a loss: named, it still gets its loss panel.
  _write(tmp_path / "rm", [{"step": s, "train/loss": 0.7 - 0.01 * s} for s in range(1, 4)])
  assert detect_stage(["train/loss"]) is None
  assert write_plots(tmp_path / "rm") == []
  paths = write_plots(tmp_path / "rm", stage="reward_model", out_dir=tmp_path / "out")
  assert [p.name for p in paths] == ["loss.png", OVERVIEW_FILE]
  assert paths[0].parent == tmp_path / "out"
  with pytest.raises(ValueError, match="stage='rl' is invalid"):
    write_plots(tmp_path / "rm", stage="rl")
  with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
    write_plots(tmp_path / "missing")


def test_read_metrics_skips_nulls_and_cut_lines_and_keeps_the_last_of_a_repeated_step(tmp_path):
  records = [{"step": s, "objective/scores": 0.1 * s, "objective/kl": 0.01 * s}
             for s in range(1, 6)]
  records.append({"step": 6, "objective/scores": None, "objective/kl": 0.1})  # NaN logged as null
  records.append({"step": 4, "objective/kl": 9.0})  # a resumed run redoes step 4
  records.append({"step": 2, "stage": "ppo", "eval/kl": 1.0})
  records.append({"step": 3, "stage": "sft", "eval/kl": 5.0})
  _write(tmp_path / "run", records)
  series = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert series["objective/scores"][0] == [1, 2, 3, 4, 5]  # null and the cut-off line skipped
  assert series["objective/kl"] == ([1, 2, 3, 4, 5, 6], [0.01, 0.02, 0.03, 9.0, 0.05, 0.1])
  assert series["eval/kl"] == ([2, 3], [1.0, 5.0])
  only_ppo = read_metrics(tmp_path / "run" / "metrics.jsonl", stage="ppo")
  assert only_ppo == {"eval/kl": ([2], [1.0])}


def test_plot_command(tmp_path, capsys):
  _write(tmp_path / "run", [{"step": 1, "objective/kl": 0.5}, {"step": 2, "objective/kl": 0.4}])
  assert main(["plot", str(tmp_path / "run")]) == 0
  out = json.loads(capsys.readouterr().out)
  plots = tmp_path / "run" / "plots"
  assert out == {"plots": [str(plots / "kl_per_response.png"), str(plots / OVERVIEW_FILE)]}
  _check_png(plots / "kl_per_response.png")
  assert main(["plot", str(tmp_path / "missing")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jax-ppo plot: error: ") and "has no metrics.jsonl" in err
  _write(tmp_path / "other", [{"step": 1, "time/total_s": 1.0}])
  assert main(["plot", str(tmp_path / "other")]) == 2
  assert "none of the plotted metrics" in capsys.readouterr().err
