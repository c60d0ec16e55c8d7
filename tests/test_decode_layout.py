"""experiments/benchmarks/decode_layout.py: the default tensor-parallel width, the shape it
compiles, and its committed records against docs/accelerators.md ("The rollout's layout"). The
compiles themselves need libtpu and about 25 minutes per cell."""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "experiments" / "benchmarks"
RECORDS = sorted((BENCHMARKS / "results" / "decode_layout").glob("*.json"))
GATHERED = sorted((BENCHMARKS / "results" / "decode_layout" / "gathered").glob("*.json"))
"""Records compiled when the FSDP decode step gathered every layer's weights on every chip (the
docs quote them as that layout's cost)."""


@pytest.fixture(scope="module")
def script():
  sys.path.insert(0, str(BENCHMARKS))
  spec = importlib.util.spec_from_file_location("decode_layout", BENCHMARKS / "decode_layout.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_default_width_divides_the_kv_heads_and_the_chips(script):
  assert script.default_width(8, 16) == 8
  assert script.default_width(8, 4) == 4
  assert script.default_width(8, 12) == 4
  assert script.default_width(1, 8) == 1


def test_the_layouts_differ_only_in_the_rollout_width(script):
  shape = script.run_shape_for("qwen3-0.6b", "grpo", 4)
  tp = script.with_decode_tensor(shape, 4)
  assert shape.ppo.sampling.decode_tensor is None and tp.ppo.sampling.decode_tensor == 4
  assert tp.ppo.sampling.max_new_tokens == shape.ppo.sampling.max_new_tokens
  assert (tp.mesh, tp.model, tp.prompt_length) == (shape.mesh, shape.model, shape.prompt_length)


@pytest.mark.parametrize("path", RECORDS + GATHERED,
                         ids=[p.stem for p in RECORDS] + [f"gathered/{p.stem}" for p in GATHERED])
def test_records_hold_both_layouts_and_the_docs_quote_them(script, path):
  record = json.loads(path.read_text())
  assert record["host"]["cpu"] and record["versions"]["libtpu"]
  doc = (ROOT / "docs" / "accelerators.md").read_text()
  for cell in record["cells"]:
    base, tp = cell["layouts"]["training mesh"], cell["layouts"][
        f"decode_tensor={cell['decode_tensor']}"]
    assert base["mesh"]["fsdp"] == cell["chips"]
    assert tp["mesh"] == {"data": cell["chips"] // cell["decode_tensor"], "fsdp": 1,
                          "tensor": cell["decode_tensor"]}
    assert "decode_state" in tp["peak_bytes_per_chip"]
    assert "decode_state" not in base["peak_bytes_per_chip"]
    for figures in (base, tp):  # the figures the docs table quotes
      assert f"| {figures['decode_step']['bytes_accessed'] / 1e9:.2f} |" in doc
      assert f"| {figures['roofline_s']:.2f} s |" in doc


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_the_fsdp_decode_step_does_its_rows_work_once(path):
  """With FSDP's weights left in place the decode step's FLOPs per chip are those of the
  tensor-parallel one (the same rows' work, split another way); when the step gathered the
  weights, XLA gathered the MLP's activations too and counted 8x that (the `gathered` record)."""
  for cell in json.loads(path.read_text())["cells"]:
    base, tp = cell["layouts"]["training mesh"], cell["layouts"][
        f"decode_tensor={cell['decode_tensor']}"]
    assert base["decode_step"]["flops"] < 1.05 * tp["decode_step"]["flops"]
