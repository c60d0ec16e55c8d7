"""Peak resident memory of the running benchmark process (shared by the scripts here)."""

from __future__ import annotations

import resource
import sys


def peak_rss_mib() -> float:
  """Peak resident memory of this process so far, in MiB.

  Linux: `VmHWM` of /proc/self/status, the high-water mark of this program's own memory
  (`ru_maxrss` carries the parent's peak over fork + exec, so a subprocess started by a large
  process would report at least the parent's peak); elsewhere `ru_maxrss`.
  """
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024  # kB
  except OSError:
    pass
  scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale / 1024
