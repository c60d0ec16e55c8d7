"""experiments/benchmarks/accelerator.sh, device_peaks.py and ppo_roofline.py: the MFU / HBM-use
arithmetic against the datasheet rows, the roofline beside a measured record, and the script's
CPU dry run end to end (tiny shapes; the real run needs a GPU)."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"


def _bench_module(name: str):
  if str(BENCH) not in sys.path:  # ppo_roofline imports its neighbours (ppo_step, host)
    sys.path.insert(0, str(BENCH))
  spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _device_peaks():
  return _bench_module("device_peaks")


def test_device_table_lookup_and_fractions(monkeypatch):
  dp = _device_peaks()
  # The rows are the library's (jax_ppo.parallel.chips; its lookup: tests/parallel/test_chips.py).
  assert dp.peaks("NVIDIA H200")["hbm_bytes_s"] == pytest.approx(4.8e12)
  assert dp.peaks("NVIDIA H100 PCIe")["table_key"] == "H100 PCIe"
  assert dp.peaks("cpu") is None
  monkeypatch.delenv("BENCH_DEVICE_KIND", raising=False)
  u = dp.utilisation("NVIDIA H200", dtype="bfloat16", flops_per_s=494.5e12, bytes_per_s=2.4e12)
  assert u["mfu"] == pytest.approx(0.5) and u["hbm_bandwidth_use"] == pytest.approx(0.5)
  assert dp.utilisation("NVIDIA H200", flops_per_s=494.7e12)["mfu"] == pytest.approx(1.0)  # TF32
  cpu = dp.utilisation("cpu", flops_per_s=1e9)
  assert cpu["mfu"] is None and cpu["peak_flops"] is None


def test_roofline_beside_the_measured_phases():
  from jax_ppo.diagnostics.plan import Cost
  from jax_ppo.parallel.chips import chip_for

  roofline = _bench_module("ppo_roofline")
  h200 = chip_for("NVIDIA H200")
  costs = {"generate": Cost(1e12, 48e9),               # bytes: 48e9 / 4.8e12 = 10 ms
           "score": Cost(9.89e12, 1e9),                 # FLOPs: 9.89e12 / 989e12 = 10 ms
           "experience_update": Cost(98.9e12, 96e9)}    # FLOPs 100 ms over bytes 20 ms
  measured = {"rollout_s": 0.05, "score_s": 0.01, "update_s": 0.3, "s_per_update": 0.4}
  out = roofline.compare(costs, measured, h200, "bfloat16")
  assert out["programs"]["generate"]["bound"] == "bytes"
  assert out["programs"]["experience_update"]["bound"] == "flops"
  phases = out["phases"]
  assert phases["rollout"]["roofline_s"] == pytest.approx(0.01)
  assert phases["score"]["roofline_s"] == pytest.approx(0.01)
  assert phases["update"]["roofline_s"] == pytest.approx(0.1)
  assert phases["update"]["programs"] == ["experience_update"]
  assert phases["rollout"]["measured_over_roofline"] == pytest.approx(5.0)
  assert phases["total"]["roofline_s"] == pytest.approx(0.12)
  assert phases["total"]["measured_over_roofline"] == pytest.approx(0.4 / 0.12)
  # float32 compute: the TF32 row (494.7 TFLOP/s) doubles the FLOP-bound programs' time
  fp32 = roofline.compare(costs, measured, h200, "float32")["phases"]
  assert fp32["update"]["roofline_s"] == pytest.approx(98.9 / 494.7)
  # a CPU without a datasheet row: costs, no roofline
  cpu = roofline.compare(costs, measured, None, "bfloat16")
  assert cpu["programs"]["score"]["flops"] == 9.89e12
  assert cpu["phases"]["total"]["roofline_s"] is None
  assert cpu["phases"]["rollout"]["measured_over_roofline"] is None
  # a program outside ppo_step.py's split is an error, not a silently missing term
  with pytest.raises(ValueError, match="replay_update"):
    roofline.compare({**costs, "replay_update": Cost(1.0, 1.0)}, measured, h200, "bfloat16")


def test_roofline_reads_only_a_ppo_step_record(tmp_path):
  roofline = _bench_module("ppo_roofline")
  with pytest.raises(SystemExit, match="not a readable ppo_step.py JSON record"):
    roofline.read_measured(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"jax_ppo": {}, "config": {"shape": "tiny", "batch": 2}}))
  with pytest.raises(SystemExit, match="missing: \\['response_length'"):
    roofline.read_measured(str(bad))


def test_roofline_run_shape_is_the_benchmarks_run():
  from jax_ppo.rollout.batching import left_pad_prompts
  from jax_ppo.rollout.config import SamplingConfig

  roofline, ppo_step = _bench_module("ppo_roofline"), _bench_module("ppo_step")
  workload = dict(shape="base", batch=64, response_length=128, dtype="bfloat16", remat="dots",
                  warmup=2, updates=4, train_layers="scan", rollout_layers="unroll")
  shape = roofline.run_shape(workload)
  hf = ppo_step.SHAPES["base"]
  assert (shape.model.num_layers, shape.model.vocab_size) == (hf["n_layer"], hf["vocab_size"])
  # the reward model and the critic: the policy's body (config.json files of their own)
  assert len(shape.reward_models) == 1
  body = lambda c: dataclasses.replace(c, source_config=None)  # noqa: E731
  assert body(shape.critic) == body(shape.reward_models[0]) == body(shape.model)
  assert (shape.dtype, shape.remat) == ("bfloat16", "dots")
  assert (shape.ppo.batch_size, shape.ppo.sampling.max_new_tokens) == (64, 128)
  assert (shape.ppo.train_scan_layers, shape.ppo.rollout_scan_layers) == (True, False)
  assert shape.ppo.total_updates == 6
  # the prompt length the sampler pads the benchmark's prompts to
  sampling = SamplingConfig(max_new_tokens=128, pad_token_id=hf["vocab_size"] - 1)
  ids, _ = left_pad_prompts(ppo_step.make_prompts(hf["vocab_size"], n=64), sampling,
                            max_context=hf["n_positions"])
  assert shape.prompt_length == ids.shape[1]


@pytest.mark.slow
def test_accelerator_script_dry_run(tmp_path):
  # The dry run checks the plumbing, not the figures: XLA:CPU's cheaper code generation halves
  # its compile-bound runs.
  flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"])
  env = {**os.environ, "PYTHON": sys.executable, "STEP_TIMEOUT": "900", "BUDGET": "3000",
         "XLA_FLAGS": flags.strip()}
  proc = subprocess.run(["bash", str(BENCH / "accelerator.sh"), "--dry-run", str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["dry_run"] is True and summary["device"].startswith("cpu")
  assert {k: v["rc"] for k, v in summary["steps"].items()} == {
      "ppo_bf16": 0, "ppo_roofline": 0, "rollout_bf16": 0, "decode_waste": 0, "forward": 0,
      "rollout_bf16w": 0, "ppo_fp32": 0}
  # The dry run computes the fractions against the H200 row (BENCH_DEVICE_KIND), each against
  # the peak of the step's compute dtype.
  for name, dtype in (("rollout_bf16", "bfloat16"), ("rollout_bf16w", "bfloat16")):
    record = json.loads((tmp_path / f"{name}.json").read_text())
    rollout = record["jax_ppo"]["accelerator"]
    assert rollout["peak_table_key"] == "H200" and rollout["peak_flops"] == pytest.approx(989e12)
    assert 0 < rollout["mfu"] < 1 and 0 < rollout["hbm_bandwidth_use"] < 1
    assert record["config"]["dtype"] == dtype
  # bfloat16 weights: half the weight bytes per decode step of the float32 ones.
  floors = [json.loads((tmp_path / f"{n}.json").read_text())["memory_floor"]
            for n in ("rollout_bf16", "rollout_bf16w")]
  assert floors[1]["bytes_per_decode_step"] < floors[0]["bytes_per_decode_step"]
  forward = json.loads((tmp_path / "forward.json").read_text())["shapes"]["tiny"]["jax"]
  assert 0 < forward["train_accelerator"]["mfu"] < 1
  for name, peak in (("ppo_bf16", 989e12), ("ppo_fp32", 494.7e12)):
    ppo = json.loads((tmp_path / f"{name}.json").read_text())["jax_ppo"]["accelerator"]
    assert 0 < ppo["mfu"] < 1 and ppo["peak_flops"] == pytest.approx(peak)
  assert summary["host_cpu"] and summary["versions"].startswith("jax ")
  # ppo_bf16's programs compiled again with every loop trip counted, beside its measured phases
  measured = json.loads((tmp_path / "ppo_bf16.json").read_text())["jax_ppo"]
  roofline = json.loads((tmp_path / "ppo_roofline.json").read_text())
  assert roofline["peak_table_key"] == "H200" and roofline["workload"]["dtype"] == "bfloat16"
  assert set(roofline["programs"]) == {"generate", "score", "experience_update"}
  for phase in ("rollout", "score", "update"):
    entry = roofline["phases"][phase]
    assert entry["measured_s"] == measured[f"{phase}_s"]
    assert entry["roofline_s"] > 0
    assert entry["measured_over_roofline"] == pytest.approx(entry["measured_s"]
                                                           / entry["roofline_s"])
  # 4 epochs of forward and backward over the policy and the critic outweigh one sampling pass
  programs = roofline["programs"]
  assert programs["experience_update"]["flops"] > 4 * programs["generate"]["flops"] > 0
  # the decode ratio of tpu_waste.py, compiled for this process's device
  waste = json.loads((tmp_path / "decode_waste.json").read_text())
  assert (waste["topology"], waste["chips"]) == ("local", 1)
  decode = waste["decode_bytes"]
  assert decode["ideal_bytes_per_chip"] == (decode["weights_bytes_per_chip"]
                                            + decode["live_kv_bytes_per_chip"]) > 0
  assert decode["ratio"] == pytest.approx(decode["compiled_bytes_per_chip"]
                                          / decode["ideal_bytes_per_chip"])


def test_tpu_waste_refuses_a_remat_the_model_count_does_not_know_before_compiling(capsys):
  waste = _bench_module("tpu_waste")
  with pytest.raises(SystemExit, match=r"--remats: remat='dot'"):
    waste.main(["--topology", "local", "--parts", "update", "--remats", "none,dot",
                "--layers", "2"])
  assert "update flops" not in capsys.readouterr().out  # nothing compiled
