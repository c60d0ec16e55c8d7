"""What a process writes under some folders, recorded by a Python audit hook: the multi-process
scripts (`tests/*/scripts/multiprocess_*.py`) use it to show that only process 0 writes files."""

import pathlib
import sys


def record_writes(*folders: str) -> list[list[str]]:
  """Installs an audit hook; returns the list it fills with `[event, path]` for each file opened
  for writing, folder created, file or folder moved, removed or deleted under `folders`."""
  watched = tuple(str(f) for f in folders)
  writes: list[list[str]] = []

  def audit(event: str, args: tuple) -> None:
    if event == "open":
      path, mode, flags = args
      writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          mode is None and isinstance(flags, int) and flags & 0o3)
      paths = [path] if writing else []
    elif event in ("os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree"):
      paths = [args[0]]
    elif event == "os.rename":
      paths = [args[0], args[1]]
    else:
      return
    for p in paths:
      if isinstance(p, bytes | str | pathlib.Path) and str(p).startswith(watched):
        writes.append([event, str(p)])

  sys.addaudithook(audit)
  return writes
