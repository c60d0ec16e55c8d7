"""The generated reference pages (jax_ppo.runs.reference): the committed docs/runs.md and
docs/presets.md are what the code writes today, every run config field is in runs.md, and
`--check` reports a stale page."""

import dataclasses
import pathlib

import pytest

from jax_ppo.ppo.presets import HYPERPARAMETER_GUIDE, PRESETS
from jax_ppo.runs.reference import PAGES, main, presets_reference, runs_reference
from jax_ppo.runs.stages import STAGE_CONFIGS

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_committed_page_is_what_the_code_writes(name):
  text = {"runs.md": runs_reference, "presets.md": presets_reference}[name]()
  assert (DOCS / name).read_text(encoding="utf-8") == text, (
      f"docs/{name} is out of date: run `python -m jax_ppo.runs.reference docs` and commit it")


def _dotted_fields(cls, prefix=""):
  for field in dataclasses.fields(cls):
    if field.init:
      yield f"{prefix}{field.name}"


def test_runs_page_lists_every_top_level_field_and_the_ppo_blocks():
  text = runs_reference()
  for cls in STAGE_CONFIGS.values():
    for key in _dotted_fields(cls):
      assert f"| `{key}` |" in text, key
  from jax_ppo.ppo.config import PPOConfig, PPOOptimizer, PPOSampling
  for cls, prefix in ((PPOConfig, "ppo."), (PPOSampling, "ppo.sampling."),
                      (PPOOptimizer, "ppo.optimizer.")):
    for key in _dotted_fields(cls, prefix):
      assert f"| `{key}` |" in text, key
  assert "| `ppo.optimizer.learning_rate` | `float` | `3.0e-06` |" in text


def test_presets_page_holds_every_preset_and_guide_row():
  text = presets_reference()
  for name in PRESETS:
    assert f"`{name}`" in text
  for key in HYPERPARAMETER_GUIDE:
    assert f"| `{key}` |" in text


def test_check_reports_a_stale_page(tmp_path, capsys):
  assert main([str(tmp_path)]) == 0
  assert main([str(tmp_path), "--check"]) == 0
  (tmp_path / "runs.md").write_text("old\n", encoding="utf-8")
  assert main([str(tmp_path), "--check"]) == 1
  assert "out of date: runs.md" in capsys.readouterr().err
