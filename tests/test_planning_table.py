"""experiments/benchmarks/tpu_planning_table.py: the walk over a generation's slices (with the
plans stubbed: the real compiles need libtpu and hours), the cells' text, and the table of
docs/accelerators.md, which must be the script's table of the committed records."""

import importlib.util
import json
import math
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "benchmarks" / "tpu_planning_table.py"
GIB = 2**30


@pytest.fixture(scope="module")
def script():
  spec = importlib.util.spec_from_file_location("tpu_planning_table", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _chips(topology: str) -> int:
  return math.prod(int(n) for n in topology.split(":")[1].split("x"))


@pytest.fixture
def stub_plans(monkeypatch):
  """16 GiB chips; resident bytes 48 GiB over the chips; every program's peak 4 GiB plus 160 GiB
  over the chips with the default remat (4x4: 14 GiB fits; 2x4: 24 GiB does not), 1 GiB less
  with full remat. Records the slices and remat policies compiled."""
  from jax_ppo.diagnostics import plan, ppo_plan, topology

  compiled = []

  class Programs:
    def __init__(self, shape, mesh):
      self.resident_bytes = {"params": 48 * GIB // mesh}

  def peaks(shape, topology_name, *, devices):
    compiled.append((topology_name, shape.remat))
    saved = GIB if shape.remat == "full" else 0
    return {"generate": GIB, "experience_update": 4 * GIB + 160 * GIB // len(devices) - saved}

  monkeypatch.setattr(plan, "topology_devices", lambda t: list(range(_chips(t))))
  monkeypatch.setattr(plan, "plan_chip", lambda devices, t: types.SimpleNamespace(
      hbm_bytes=16 * GIB))
  monkeypatch.setattr(topology, "slice_mesh", lambda devices, mesh, topology: len(devices))
  monkeypatch.setattr(ppo_plan, "RunPrograms", Programs)
  monkeypatch.setattr(ppo_plan, "memory_peaks", peaks)
  return compiled


def test_the_walk_skips_what_cannot_hold_its_arrays_and_stops_at_the_first_fit(
    script, stub_plans, tmp_path):
  record = script.plan_cell("qwen3-0.6b", "ppo", "v5e", tmp_path, costs=False)
  # 2x2 (4 chips): 12 GiB resident, compiled: 44 GiB peak (43 with full remat); 2x4: 6 GiB
  # resident, 24 GiB peak (23); 4x4: 14 GiB with the default remat, fits; nothing larger is
  # compiled.
  assert stub_plans == [("v5e:2x2", "dots"), ("v5e:2x2", "full"), ("v5e:2x4", "dots"),
                        ("v5e:2x4", "full"), ("v5e:4x4", "dots")]
  assert record["topology"] == "v5e:4x4" and record["chips"] == 16 and record["plan"] is None
  assert record["remat"] == "dots"
  assert [t["topology"] for t in record["tried"]] == [t for t, _ in stub_plans]
  assert record["tried"][2]["peak_bytes_per_chip"] == 24 * GIB
  assert record["rows"] == 64 and record["resident_bytes_per_chip"] == 3 * GIB
  assert json.loads((tmp_path / "qwen3-0.6b_ppo_v5e.json").read_text()) == record
  assert script.cell_text(record) == "v5e:4x4 (16 chips), 14.0 of 16"


def test_a_slice_that_fits_with_full_remat_only_is_the_cell_and_says_so(script, stub_plans,
                                                                        monkeypatch, tmp_path):
  from jax_ppo.diagnostics import plan

  monkeypatch.setattr(plan, "plan_chip",
                      lambda devices, t: types.SimpleNamespace(hbm_bytes=6 * GIB))
  record = script.plan_cell("qwen3-0.6b", "ppo", "v5e", tmp_path, costs=False)
  # 6 GiB chips: 4x8 (32 chips) peaks at 9 GiB, 8 with full remat; 8x8 (64 chips) at 6.5, 5.5
  # with full remat: fits.
  assert stub_plans[-2:] == [("v5e:8x8", "dots"), ("v5e:8x8", "full")]
  assert record["topology"] == "v5e:8x8" and record["remat"] == "full"
  assert max(record["peak_bytes_per_chip"].values()) == 5.5 * GIB
  assert script.cell_text(record) == "v5e:8x8 (64 chips), 5.5 of 6 with remat=full"


def test_a_generation_without_a_fit_says_how_far_it_was_tried(script, stub_plans, monkeypatch,
                                                             tmp_path):
  from jax_ppo.diagnostics import ppo_plan

  monkeypatch.setattr(ppo_plan, "memory_peaks", lambda *a, devices: {"update": 17 * GIB})
  record = script.plan_cell("qwen3-8b", "grpo", "v6e", tmp_path, costs=False)
  assert record["topology"] is None and record["tried"][-1]["topology"] == "v6e:16x16"
  assert script.cell_text(record) == "none up to v6e:16x16"
  assert script.cell_text(None) == "not planned"


def test_a_cell_with_costs_shows_the_roofline_time_per_update(script):
  record = {"topology": "v5p:2x2x1", "chips": 4, "hbm_per_chip_bytes": 95 * GIB,
            "peak_bytes_per_chip": {"generate": 10 * GIB, "experience_update": 28.7 * GIB},
            "plan": {"programs": {"generate": {"roofline_s": 0.25},
                                  "experience_update": {"roofline_s": 0.5}}},
            "decode_weights": script.DECODE_WEIGHTS}
  assert script.cell_text(record) == "v5p:2x2x1 (4 chips), 28.7 of 95, 0.75 s"
  # A rollout compiled when the decode step gathered every layer's weights: marked.
  assert script.cell_text(dict(record, decode_weights=None)).endswith(", 0.75 s †")
  record["plan"]["costs_rows_divisor"] = 4  # extrapolated from 1/4 and 1/2 of the rows
  assert script.cell_text(record) == "v5p:2x2x1 (4 chips), 28.7 of 95, ~0.75 s"
  # GPU cells have no costs: memory only.
  record["plan"]["programs"]["generate"]["roofline_s"] = None
  assert script.cell_text(record) == "v5p:2x2x1 (4 chips), 28.7 of 95"


def test_costs_are_added_to_a_memory_only_cell_at_its_own_slice_and_remat(
    script, stub_plans, monkeypatch, tmp_path):
  from jax_ppo.diagnostics import ppo_plan

  planned = []

  def plan_run(shape, topology_name, *, devices, advice):
    planned.append((topology_name, shape.remat, shape.ppo.batch_size, len(devices)))
    return types.SimpleNamespace(to_json=lambda: {"programs": {
        "generate": {"roofline_s": 1.25}, "experience_update": {"roofline_s": 0.5}}})

  monkeypatch.setattr(ppo_plan, "plan_run", plan_run)
  record = script.plan_cell("qwen3-0.6b", "ppo", "v5e", tmp_path, costs=False)
  assert record["plan"] is None and not planned
  with_costs = script.add_costs(record, tmp_path)
  assert planned == [("v5e:4x4", "dots", 64, 16)]  # the cell's slice and remat; no walk
  assert script.cell_text(with_costs) == "v5e:4x4 (16 chips), 14.0 of 16, 1.75 s"
  written = json.loads((tmp_path / "qwen3-0.6b_ppo_v5e.json").read_text())
  assert written["plan"] == with_costs["plan"] and written["plan_s"] >= 0
  assert script.add_costs(with_costs, tmp_path) is with_costs  # planned already: unchanged
  gpu = dict(record, generation="h100", topology="h100:2", chips=2)
  assert script.add_costs(gpu, tmp_path) is gpu and len(planned) == 1  # GPUs: memory only
  assert script.cell_text(gpu).startswith("h100:2 (2 GPUs), ")
  assert script.cell_text(dict(gpu, topology="h100:1", chips=1)).startswith("h100:1 (1 GPU), ")
  assert "| h100: GPUs, peak GiB per GPU |" in script.table([record, gpu])


def test_recosting_replaces_the_rollout_of_a_cell_compiled_with_gathered_decode_weights(
    script, stub_plans, monkeypatch, tmp_path):
  from jax_ppo.diagnostics import ppo_plan

  planned = []

  def plan_run(shape, topology_name, *, devices, advice, only=None):
    planned.append((topology_name, shape.remat, len(devices), only))
    programs = {"generate": {"roofline_s": 0.25, "peak_bytes_per_chip": 2 * GIB}}
    if only is None:
      programs["experience_update"] = {"roofline_s": 0.5, "peak_bytes_per_chip": 14 * GIB}
    return types.SimpleNamespace(costs_rows_divisor=None,
                                 to_json=lambda: {"fits": True, "costs_rows_divisor": None,
                                                  "programs": programs})

  monkeypatch.setattr(ppo_plan, "plan_run", plan_run)
  record = script.plan_cell("qwen3-0.6b", "ppo", "v5e", tmp_path, costs=True)
  assert record["decode_weights"] == script.DECODE_WEIGHTS  # planned now: nothing to recost
  assert script.recost_generate(record, tmp_path) is record and len(planned) == 1
  old = dict(record, decode_weights=None, plan=dict(record["plan"], programs=dict(
      record["plan"]["programs"], generate={"roofline_s": 1.25, "peak_bytes_per_chip": GIB})))
  assert script.cell_text(old) == "v5e:4x4 (16 chips), 14.0 of 16, 1.75 s †"
  new = script.recost_generate(old, tmp_path)
  assert planned[-1] == ("v5e:4x4", "dots", 16, ("generate",))  # the rollout alone, no walk
  assert script.cell_text(new) == "v5e:4x4 (16 chips), 14.0 of 16, 0.75 s"
  assert new["peak_bytes_per_chip"]["generate"] == 2 * GIB and new["plan"]["fits"]
  assert new["plan"]["programs"]["experience_update"] == old["plan"]["programs"][
      "experience_update"]
  written = json.loads((tmp_path / "qwen3-0.6b_ppo_v5e.json").read_text())
  assert written["plan"] == new["plan"] and written["recost_s"] >= 0
  assert written["recost_host"]["cores"] >= 1 and written["host"] == record["host"]


def test_the_docs_table_is_the_scripts_table_of_the_committed_records(script):
  records = [json.loads(p.read_text()) for p in sorted(script.RESULTS.glob("*.json"))]
  assert records, "no planning records committed"
  docs = (ROOT / "docs" / "accelerators.md").read_text()
  assert script.table(records) in docs


def test_no_committed_cell_is_stale(script):
  """Every committed GPU cell fits `GPU_MEM_FRACTION` of its card (JAX's allocator's share the
  table's runs start with), and says so."""
  for path in sorted(script.RESULTS.glob("*.json")):
    record = json.loads(path.read_text())
    assert not script.stale(record), path.name
    if record["generation"] in script.GPUS and record["topology"] is not None:
      assert record["memory_fraction"] == script.GPU_MEM_FRACTION, path.name


def test_the_program_memory_table_shows_bytes_and_refusals():
  spec = importlib.util.spec_from_file_location(
      "program_memory", SCRIPT.parent / "program_memory.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  compiled = {"argument_bytes": 4 * GIB, "output_bytes": 3 * GIB, "alias_bytes": 3 * GIB,
              "temp_bytes": 5 * GIB, "outside_bytes": 0, "peak_bytes_per_chip": 9 * GIB}
  refused = {"refused": "program 'update' does not compile", "required_bytes": int(16.19 * GIB),
             "temporaries_only": True}
  text = module.table([{"topology": "v5e:8x8", "rows": 64, "remat": "full",
                        "programs": {"update": compiled}},
                       {"topology": "v5e:8x8", "rows": 64, "remat": "dots",
                        "programs": {"update": refused}}])
  lines = text.splitlines()
  assert lines[2] == "| v5e:8x8 | 64 | full | update | 4.00 | 0.00 | 5.00 | 0.00 | 9.00 |"
  assert lines[3].startswith("| v5e:8x8 | 64 | dots | update | refused: needs 16.19 (temporaries)")


def test_gpu_cells_fit_the_share_jax_allocates_and_stale_ones_walk_on(script, stub_plans,
                                                                     monkeypatch, tmp_path):
  # stub_plans: the slices' devices and meshes
  """A GPU cell must fit `GPU_MEM_FRACTION` of the card (the runs raise JAX's allocator's share
  to it); a cell written against the whole card whose peak is over that share is stale, and
  `--skip-existing` walks on from its slice."""
  from jax_ppo.diagnostics import gpu_topology, plan, ppo_plan

  assert script.GPU_MEM_FRACTION == gpu_topology.RAISED_MEM_FRACTION
  monkeypatch.setattr(plan, "plan_chip",
                      lambda devices, t: types.SimpleNamespace(hbm_bytes=80 * GIB))
  # 78 GiB on 1 GPU, 39 on 2, ...: over 95% of 80 GiB on one GPU, under it on two
  compiled = []

  def peaks(shape, topology_name, *, devices):
    compiled.append((topology_name, shape.remat))
    return {"update": 78 * GIB // len(devices)}

  monkeypatch.setattr(ppo_plan, "memory_peaks", peaks)
  record = script.plan_cell("qwen3-1.7b", "ppo", "h100", tmp_path, costs=False)
  assert record["topology"] == "h100:2" and record["memory_fraction"] == 0.95
  assert record["hbm_per_chip_bytes"] == 80 * GIB and not script.stale(record)
  # a record of 78 GiB on h100:1 with the default remat, written when the whole card counted:
  # walked on from h100:1 with full remat (78 GiB still), then h100:2
  old = dict(record, topology="h100:1", chips=1, peak_bytes_per_chip={"update": 78 * GIB},
             tried=[{"topology": "h100:1", "remat": "dots", "peak_bytes_per_chip": 78 * GIB}])
  del old["memory_fraction"]
  assert script.stale(old)
  path = tmp_path / "qwen3-1.7b_ppo_h100.json"
  path.write_text(json.dumps(old))
  del compiled[:]
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.95")  # restored after: main sets it
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  script.main(["--models", "qwen3-1.7b", "--runs", "ppo", "--generations", "h100",
               "--out", str(tmp_path), "--memory-only", "--skip-existing"])
  walked = json.loads(path.read_text())
  assert walked["topology"] == "h100:2"
  assert compiled == [("h100:1", "full"), ("h100:2", "dots")]
  assert [(t["topology"], t["remat"]) for t in walked["tried"]] == [
      ("h100:1", "dots"), ("h100:1", "full"), ("h100:2", "dots")]
  # a TPU cell may use the whole chip; the same 78 GiB fits a v5p chip's 95 GiB
  tpu = dict(record, generation="v5p", topology="v5p:2x2x1", hbm_per_chip_bytes=95 * GIB,
             peak_bytes_per_chip={"update": 94 * GIB})
  assert not script.stale(tpu)
