"""PNG plots of a run folder's metrics (issue 10 item 8): one file per panel whose metrics are
present (PPO: reward, KL, entropy, response length; SFT/RM: loss, accuracy), valid PNGs, written
by `write_plots` and by `jax-ppo plot RUN_DIR`."""

from __future__ import annotations

import json

import pytest

from jax_ppo.cli import main
from jax_ppo.logging.plots import panel_metrics, read_metrics, write_plots

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


def test_ppo_metrics_give_reward_kl_entropy_and_length_plots(tmp_path):
  records = [{"step": s, "objective/scores": 0.1 * s, "objective/kl": 0.01 * s,
              "objective/entropy": 3.0 - 0.1 * s, "rollout/response_length": 10 + s,
              "reward/length": float(s), "reward/length_std": 1.0, "policy/grad_norm": 1.0}
             for s in range(1, 6)]
  records.append({"step": 6, "objective/scores": None, "objective/kl": 0.1})  # NaN logged as null
  _write(tmp_path / "run", records)
  paths = write_plots(tmp_path / "run")
  assert sorted(p.name for p in paths) == ["entropy.png", "kl.png", "response_length.png",
                                           "reward.png"]
  for path in paths:
    assert path.parent == tmp_path / "run" / "plots"
    _check_png(path)
  series = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert series["objective/scores"][0] == [1, 2, 3, 4, 5]  # null and the cut-off line skipped
  assert series["objective/kl"][0] == [1, 2, 3, 4, 5, 6]
  assert panel_metrics(list(series), "reward") == ["objective/scores", "reward/length"]


def test_sft_and_reward_model_metrics_give_loss_and_accuracy(tmp_path):
  _write(tmp_path / "sft", [{"step": s, "train/loss": 3.0 / s, "train/perplexity": 20.0 / s}
                            for s in range(1, 4)] + [{"step": 3, "eval/loss": 1.2}])
  assert sorted(p.name for p in write_plots(tmp_path / "sft")) == ["loss.png", "perplexity.png"]
  _write(tmp_path / "rm", [{"step": s, "train/loss": 0.7, "train/accuracy": 0.5 + 0.1 * s}
                           for s in range(1, 4)])
  paths = write_plots(tmp_path / "rm")
  assert sorted(p.name for p in paths) == ["accuracy.png", "loss.png"]
  for path in paths:
    _check_png(path)


def test_plot_command(tmp_path, capsys):
  _write(tmp_path / "run", [{"step": 1, "objective/kl": 0.5}, {"step": 2, "objective/kl": 0.4}])
  assert main(["plot", str(tmp_path / "run")]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out == {"plots": [str(tmp_path / "run" / "plots" / "kl.png")]}
  _check_png(tmp_path / "run" / "plots" / "kl.png")
  assert main(["plot", str(tmp_path / "missing")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jax-ppo plot: error: ") and "has no metrics.jsonl" in err
  _write(tmp_path / "other", [{"step": 1, "time/total_s": 1.0}])
  assert main(["plot", str(tmp_path / "other")]) == 2
  assert "none of the plotted metrics" in capsys.readouterr().err
