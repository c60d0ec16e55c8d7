"""`jax_ppo.models.hf.hub`: Hugging Face Hub ids found in a local cache folder with the hub's
layout (`models--org--name/refs/<branch>`, `snapshots/<commit>/...`), built here; an existing
local folder wins, an absent id is one error naming the field, the id and `hf download`, and
nothing touches the network."""

from __future__ import annotations

import json
import os
import pathlib
import socket

import pytest

from jax_ppo.models.hf import (
  download_command,
  hub_cache_dir,
  hub_model_folder,
  is_hub_id,
  split_hub_id,
)
from tests.tiny_hf_run import COMMIT, cache_snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty hub cache named by HF_HUB_CACHE; the working directory is an empty folder; any
  network connection fails the test."""
  folder = tmp_path / "hub"
  folder.mkdir()
  for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HF_HUB_CACHE", str(folder))
  work = tmp_path / "work"
  work.mkdir()
  monkeypatch.chdir(work)

  def refuse(*args, **kwargs):
    raise AssertionError("a network connection was attempted")

  monkeypatch.setattr(socket.socket, "connect", refuse)
  return folder


@pytest.mark.parametrize("text, parts", [
    ("org/name", ("org/name", None)),
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
    ("org/name@v1.0", ("org/name", "v1.0")),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    (f"org/name@{COMMIT}", ("org/name", COMMIT)),
    ("name", None),  # a bare name: a relative folder, not `org/name`
    ("runs/sft/hf_model", None),
    ("/models/org/name", None),
    ("./org/name", None),
    ("../org/name", None),
    ("org--x/name", None),
    ("org/na..me", None),
    ("org/name.git", None),
    ("shape:qwen3-8b", None),
    ("org/name@", None),
])
def test_what_reads_as_a_hub_id(text, parts):
  assert split_hub_id(text) == parts
  assert is_hub_id(text) == (parts is not None)


def test_an_id_in_the_cache_is_its_snapshot_folder(cache):
  snapshot = cache_snapshot(cache, "org/name")
  assert hub_model_folder("org/name", field="F.model_path") == str(snapshot)
  # A revision: a branch or tag (refs/<name>) or a commit (snapshots/<commit>).
  other = cache_snapshot(cache, "org/name", commit="f" * 40, branch="v2")
  assert hub_model_folder("org/name@v2", field="F") == str(other)
  assert hub_model_folder(f"org/name@{'f' * 40}", field="F") == str(other)
  assert hub_model_folder("org/name@main", field="F") == str(snapshot)


def test_hf_home_names_the_cache_without_hf_hub_cache(cache, tmp_path, monkeypatch):
  monkeypatch.delenv("HF_HUB_CACHE")
  monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
  assert hub_cache_dir() == str(tmp_path / "home" / "hub")
  snapshot = cache_snapshot(tmp_path / "home" / "hub", "org/name")
  assert hub_model_folder("org/name", field="F") == str(snapshot)


def test_an_existing_local_path_wins_over_the_hub_id(cache):
  cache_snapshot(cache, "org/name")
  pathlib.Path("org/name").mkdir(parents=True)  # a folder of that name in the working directory
  assert hub_model_folder("org/name", field="F") == "org/name"
  assert hub_model_folder(str(cache), field="F") == str(cache)  # any existing path: itself


def test_a_path_that_is_no_hub_id_is_left_to_the_loader(cache):
  assert hub_model_folder("runs/sft/hf_model", field="F") == "runs/sft/hf_model"
  assert hub_model_folder("/no/such/folder", field="F") == "/no/such/folder"


def test_an_id_absent_from_the_cache_names_the_field_the_id_and_the_command(cache):
  with pytest.raises(FileNotFoundError) as info:
    hub_model_folder("org/absent", field="SFTRunConfig.model_path")
  message = str(info.value)
  assert message.startswith("SFTRunConfig.model_path='org/absent': no local folder there")
  assert "`hf download org/absent`" in message and "huggingface-cli download org/absent" in message
  assert repr(str(cache)) in message
  # Another revision of a cached id is absent too, and the command names it.
  cache_snapshot(cache, "org/name")
  with pytest.raises(FileNotFoundError, match="`hf download org/name --revision v9`"):
    hub_model_folder("org/name@v9", field="F")
  assert download_command("org/name") == "hf download org/name"


def test_a_snapshot_without_config_json_is_a_partial_download(cache):
  cache_snapshot(cache, "org/name", files=("tokenizer.json",))
  with pytest.raises(FileNotFoundError, match=r"F='org/name': the cached .* has no config\.json"
                                              r".*`hf download org/name`"):
    hub_model_folder("org/name", field="F")


def test_a_snapshot_missing_files_of_its_cached_listing_is_incomplete(cache):
  """huggingface_hub >= 2.4 keeps each commit's file list (`<repo>/trees/<commit>.json`): a
  snapshot without some of those files is an interrupted download. Older releases, such as 1.3.0
  (the lower bound: transformers 5.0 needs it), keep no list and cannot tell."""
  from huggingface_hub import errors

  if not hasattr(errors, "IncompleteSnapshotError"):
    pytest.skip("this huggingface_hub keeps no cached file list (no IncompleteSnapshotError)")
  snapshot = cache_snapshot(cache, "org/name")  # config.json only
  trees = snapshot.parents[1] / "trees"
  trees.mkdir()
  (trees / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": {
      "config.json": {"size": 2, "blob_id": "a" * 40},
      "model.safetensors": {"size": 8, "blob_id": "b" * 40}}}))
  with pytest.raises(FileNotFoundError, match=r"F='org/name': the Hugging Face Hub snapshot "
                                              r"of 'org/name' .* is incomplete.*`hf download "
                                              r"org/name`"):
    hub_model_folder("org/name", field="F")
  (snapshot / "model.safetensors").write_bytes(b"12345678")
  assert hub_model_folder("org/name", field="F") == str(snapshot)


def test_the_cache_folder_is_read_when_called(cache, tmp_path, monkeypatch):
  """The environment at the call decides, not the one `huggingface_hub` was imported with."""
  import huggingface_hub  # noqa: F401  (imported before the variable changes)

  other = tmp_path / "other"
  snapshot = cache_snapshot(other, "org/late")
  with pytest.raises(FileNotFoundError):
    hub_model_folder("org/late", field="F")
  monkeypatch.setenv("HF_HUB_CACHE", str(other))
  assert hub_model_folder("org/late", field="F") == str(snapshot)
  assert os.path.isfile(os.path.join(snapshot, "config.json"))
