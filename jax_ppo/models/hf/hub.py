"""Hugging Face Hub ids as model folders: `org/name` (or `org/name@revision`) found in the local
Hugging Face cache, never downloaded.

A model field of a run config (`model_path`, `policy_path`, ...) names a local folder written by
`save_pretrained`, or a Hub id whose snapshot `hf download org/name` put into the cache.
`hub_model_folder` decides, in this order:

1. an existing local path is used as it is (a folder `org/name` under the working directory wins
   over the Hub id of the same name);
2. a Hub id (`is_hub_id`: `namespace/name`, an optional `@revision`, a branch, tag or commit) is
   looked up in the cache (`huggingface_hub.snapshot_download(..., local_files_only=True)`:
   `models--org--name/refs/<revision>` names the commit, `snapshots/<commit>/` holds the files)
   and its snapshot folder is returned; an id absent from the cache, or a snapshot without
   `config.json`, is one `FileNotFoundError` naming the field, the id, the cache folder and the
   command that downloads it;
3. anything else is returned unchanged (the model loader's own checks report it).

The cache folder is read from the environment at each call, as `huggingface_hub` reads it when
it is imported: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub` (`HF_HOME`
defaults to `$XDG_CACHE_HOME/huggingface`, i.e. `~/.cache/huggingface`).
"""

from __future__ import annotations

import os
import re

_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]*))?"
)


def split_hub_id(text: str) -> tuple[str, str | None] | None:
  """`(repo_id, revision or None)` when `text` reads as a Hub id `namespace/name[@revision]`
  (huggingface_hub's rules: letters, digits, `-`, `_`, `.`; no `--` or `..`; at most 96
  characters), else None."""
  if not isinstance(text, str):
    return None
  match = _HUB_ID.fullmatch(text)
  if match is None:
    return None
  repo = match["repo"]
  if len(repo) > 96 or "--" in repo or ".." in repo or repo.endswith((".git", ".", "-")):
    return None
  return repo, match["revision"]


def is_hub_id(text: str) -> bool:
  """Whether `text` reads as a Hub id `namespace/name[@revision]` (`split_hub_id`)."""
  return split_hub_id(text) is not None


def hub_cache_dir() -> str:
  """The Hugging Face Hub cache folder the environment names now (`HF_HUB_CACHE`,
  `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`), expanded."""
  env = os.environ
  folder = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
  if not folder:
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    folder = os.path.join(home, "hub")
  return os.path.expandvars(os.path.expanduser(folder))


def download_command(repo_id: str, revision: str | None = None) -> str:
  """The command that puts `repo_id` (at `revision`) into the cache."""
  return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def hub_model_folder(path: str, *, field: str) -> str:
  """The local model folder `path` names: itself when it exists or is not a Hub id, else the
  snapshot of the Hub id in the local cache (see the module's docstring). Reads no weights and
  never touches the network.

  Args:
    path: a local path, or a Hub id `namespace/name[@revision]`.
    field: how errors name the setting (e.g. "SFTRunConfig.model_path").

  Raises:
    FileNotFoundError: `path` is no local path and, as a Hub id, is not in the cache (or its
      cached snapshot lacks `config.json`); the message names `field`, the id, the cache folder
      and the download command.
  """
  if os.path.exists(path):
    return path
  parts = split_hub_id(path)
  if parts is None:
    return path
  repo_id, revision = parts
  from huggingface_hub import errors, snapshot_download

  # A snapshot whose cached file list names files it lacks (huggingface_hub >= 2.4 tells).
  incomplete = getattr(errors, "IncompleteSnapshotError", ())

  cache = hub_cache_dir()
  command = download_command(repo_id, revision)
  at = f" at revision {revision!r}" if revision else ""
  try:
    folder = snapshot_download(repo_id, revision=revision, cache_dir=cache,
                               local_files_only=True)
  except incomplete:
    raise FileNotFoundError(
        f"{field}={path!r}: the Hugging Face Hub snapshot of {repo_id!r}{at} in the local cache "
        f"{cache!r} is incomplete (an interrupted download); run `{command}` to complete it. "
        "Runs never download.") from None
  except (FileNotFoundError, errors.HFValidationError):  # LocalEntryNotFoundError: not cached
    raise FileNotFoundError(
        f"{field}={path!r}: no local folder there, and the Hugging Face Hub id {repo_id!r}{at} "
        f"is not in the local cache {cache!r} (HF_HUB_CACHE, or HF_HOME/hub). Download it "
        f"first with `{command}` (older huggingface_hub: `huggingface-cli download "
        f"{repo_id}`), or give a local folder written by save_pretrained. Runs never "
        "download.") from None
  if not os.path.isfile(os.path.join(folder, "config.json")):
    raise FileNotFoundError(
        f"{field}={path!r}: the cached Hugging Face Hub snapshot {folder!r} of {repo_id!r}{at} "
        f"has no config.json (only some of its files were downloaded); run `{command}` to "
        "download the whole model.")
  return folder


__all__ = ["download_command", "hub_cache_dir", "hub_model_folder", "is_hub_id", "split_hub_id"]
