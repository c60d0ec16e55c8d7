"""experiments/benchmarks/host.py: every benchmark record names the CPU model and its vector
instruction sets (the same ratio to a PyTorch reference differs by 2x between hosts)."""

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse4_1 sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu
"""


def _host():
  spec = importlib.util.spec_from_file_location("host", BENCH / "host.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_record_names_the_cpu_and_its_vector_instruction_sets(tmp_path):
  host = _host()
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text(INTEL)
  r = host.host_record(str(cpuinfo))
  assert r["cpu"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
  assert r["instruction_sets"] == ["amx_bf16", "amx_tile", "avx", "avx2", "avx512_bf16",
                                   "avx512bw", "avx512f", "fma", "sse4_1", "sse4_2"]
  line = host.host_line(r)
  assert "Platinum 8481C" in line and "avx512f" in line and "amx_tile" in line
  assert "avx2" not in line  # the widest sets only
  # No cpuinfo (macOS): still a record, named by the platform.
  r = host.host_record(str(tmp_path / "absent"))
  assert r["cpu"] and r["instruction_sets"] == [] and "no wide vector sets" in host.host_line(r)


def test_every_benchmark_that_writes_a_record_writes_the_host():
  writers = [p for p in sorted(BENCH.glob("*.py")) if "json.dump(" in p.read_text()]
  assert len(writers) >= 10
  missing = [p.name for p in writers if "host_record()" not in p.read_text()]
  assert missing == []
