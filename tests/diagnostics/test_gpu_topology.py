"""GPU topology names, the target configs handed to XLA and the one-line errors of
`jax-ppo plan --topology h100:8` where JAX's CUDA plugin is missing (no plugin needed; the
compiles themselves: tests/diagnostics/test_gpu_plan.py)."""

import dataclasses
import re

import pytest
from tiny_plan_run import write_run

from jax_ppo import cli
from jax_ppo.diagnostics import gpu_topology, plan
from jax_ppo.diagnostics.topology import PlanError
from jax_ppo.parallel.chips import chip_for


@pytest.mark.parametrize("name, nodes, gpus, chip", [
    ("h100:8", 1, 8, "H100"), ("H200:2x8", 2, 8, "H200"), ("a100-80gb:4", 1, 4,
                                                            "A100-SXM4-80GB")])
def test_names_parse_to_nodes_and_gpus(name, nodes, gpus, chip):
  assert gpu_topology.is_gpu_topology(name)
  part, n, g = gpu_topology.parse_gpu_topology(name)
  assert (n, g, part.chip) == (nodes, gpus, chip)
  # the device kind XLA will report finds the part's own datasheet row
  assert chip_for(part.device_kind).name == chip


@pytest.mark.parametrize("name", ["v5e:2x4", "v5p:2x2x1", "h100", "b200:8", "h100:2x2x8"])
def test_tpu_slices_and_other_names_are_not_gpu_topologies(name):
  assert not gpu_topology.is_gpu_topology(name)


@pytest.mark.parametrize("name, match", [("h100:16", "1 to 8 GPUs per node"),
                                         ("h100:0x8", "at least one node"),
                                         ("b200:8", "PART one of h100, h200, a100-80gb")])
def test_bad_gpu_topologies_name_the_form(name, match):
  with pytest.raises(PlanError, match=match):
    gpu_topology.parse_gpu_topology(name)


def test_target_config_carries_the_parts_figures():
  for part in gpu_topology.GPU_PARTS.values():
    text = part.target_config()
    row = part.row()
    fields = dict(re.findall(r"^\s*(\w+): ([\w.\"]+)", text, flags=re.M))
    assert int(fields["device_memory_size"]) == row.hbm_bytes
    assert int(fields["memory_bandwidth"]) == int(row.hbm_bytes_s)
    assert int(fields["core_count"]) == part.sms
    assert f'device_description_str: "{part.device_kind}"' in text
    major, minor = part.compute_capability
    assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text


@pytest.mark.skipif(gpu_topology.cuda_plugin_installed(),
                    reason="JAX's CUDA plugin is installed in this venv")
def test_missing_plugin_is_one_line_naming_the_extra(tmp_path, capsys):
  config = write_run(tmp_path, layers=1)
  with pytest.raises(PlanError, match=r"pip install \"jax_ppo\[plan-gpu\]\""):
    plan.topology_devices("h100:8")
  assert cli.main(["plan", str(config), "--topology", "h200:2x8"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "jax_ppo[plan-gpu]" in err and "CUDA plugin" in err


def test_a_gpu_topology_with_bad_sizes_is_refused_before_anything_loads(capsys):
  with pytest.raises(PlanError, match="1 to 8 GPUs per node"):
    gpu_topology.gpu_devices("h100:9")


@pytest.mark.parametrize("environ, fraction", [
    ({}, 0.75), ({"XLA_CLIENT_MEM_FRACTION": "0.9"}, 0.9),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"}, 0.95), ({"XLA_CLIENT_MEM_FRACTION": ""}, 0.75),
    ({"XLA_CLIENT_MEM_FRACTION": "1"}, 1.0)])
def test_allocator_fraction_is_read_as_jax_reads_it(environ, fraction):
  assert gpu_topology.allocator_fraction(environ) == fraction


@pytest.mark.parametrize("environ, match", [
    ({"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"},
     "both XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are set"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "95%"}, r"XLA_PYTHON_CLIENT_MEM_FRACTION='95%'.*\(0, 1\]"),
    ({"XLA_CLIENT_MEM_FRACTION": "0"}, r"XLA_CLIENT_MEM_FRACTION='0'.*number in \(0, 1\]"),
    ({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "XLA_CLIENT_MEM_FRACTION=0.95")])
def test_a_bad_allocator_fraction_names_the_variable(environ, match):
  with pytest.raises(PlanError, match=match):
    gpu_topology.allocator_fraction(environ)


def _gpu_plan(peak_gib: float, fraction: float) -> plan.Plan:
  program = plan.ProgramPlan(argument_bytes=int(peak_gib * 2**30), output_bytes=0,
                             alias_bytes=0, temp_bytes=0, outside_bytes=0, flops=None,
                             bytes_accessed=None, xla_flops=None, xla_bytes_accessed=None,
                             roofline_s=None)
  return plan.Plan(topology="h100:1", chip="H100", chips=1, hosts=1,
                   hbm_per_chip_bytes=80 * 2**30, mesh={"data": 1, "fsdp": 1},
                   dtype="bfloat16", resident_bytes_per_chip={},
                   programs={"experience_update": program}, memory_fraction=fraction)


@pytest.mark.parametrize("peak_gib, fraction, fits, advice", [
    (59.0, 0.75, True, None),  # within 75% of 80 GiB: fits as JAX starts by default
    (68.0, 0.75, False, ["XLA_CLIENT_MEM_FRACTION=0.95"]),  # over 60, under 76 GiB
    (77.0, 0.75, False, ["XLA_CLIENT_MEM_FRACTION=0.95", "lora.rank=16"]),  # over 95% too
    (68.0, 0.95, True, None),
    (77.0, 0.95, False, ["lora.rank=16"])])  # the share is raised already
def test_a_gpu_plan_fits_the_allocators_share_and_advises_raising_it(peak_gib, fraction, fits,
                                                                    advice):
  """`fraction_advice` with a stub search whose change (LoRA) brings the peak to 70 GiB: it
  fits 95% of the card, not 75%."""
  from jax_ppo.diagnostics.advice import Advice

  searched = []

  def advised(usable):
    searched.append(usable)
    return [Advice(("lora.rank=16",), "LoRA adapters", 70 * 2**30, 70 * 2**30 <= usable)]

  p = _gpu_plan(peak_gib, fraction)
  assert p.usable_bytes_per_chip == int(fraction * 80 * 2**30) and p.fits is fits
  if advice is not None:
    found = plan.fraction_advice(p, advised)
    assert [list(a.change) for a in found] == [advice] and found[0].fits
    # searched against the raised share, never against 75% of the card
    assert searched == ([] if len(advice) == 1 and fraction < 0.95 else [int(0.95 * 80 * 2**30)])
    if fraction == 0.75:
      assert "75% of each GPU by default" in found[0].why
  as_json = p.to_json()
  assert (as_json["memory_fraction"], as_json["usable_bytes_per_chip"],
          as_json["fits"]) == (fraction, p.usable_bytes_per_chip, fits)
  text = plan.format_plan(p)
  assert f"{fraction * 80:.1f} of it for JAX's allocator (XLA_CLIENT_MEM_FRACTION {fraction})" \
      in text and f"GiB of {fraction * 80:.1f})" in text


def test_tpu_advice_is_searched_against_the_whole_chip():
  tpu = dataclasses.replace(_gpu_plan(17.0, 1.0), topology="v5e:2x2", chip="v5e",
                            hbm_per_chip_bytes=16 * 2**30)
  searched = []
  assert plan.fraction_advice(tpu, lambda usable: searched.append(usable) or []) == []
  assert searched == [16 * 2**30]


def test_a_plan_reads_the_share_for_gpus_only(monkeypatch):
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
  assert plan.memory_fraction_of("h200:2x8") == 0.5
  assert plan.memory_fraction_of("v5e:2x4") == 1.0  # a TPU program may use the chip's HBM
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "half")
  with pytest.raises(PlanError, match="XLA_CLIENT_MEM_FRACTION='half'"):
    plan.memory_fraction_of("h100:8")
