"""`jax_ppo.runs.paths`: a path a run writes that is, contains or lies inside one it reads is one
error naming both fields and paths; an export may not be or hold a run folder; apart paths
pass. Symbolic links and `..` are resolved before comparing."""

import os

import pytest

from jax_ppo.runs.paths import check_run_paths, relation


def test_relations(tmp_path):
  model = tmp_path / "models" / "m"
  assert relation(model, model) == "is"
  assert relation(model / "run", model) == "lies inside"
  assert relation(tmp_path / "models", model) == "contains"
  assert relation(tmp_path / "runs" / "a", model) is None
  assert relation(tmp_path / "models" / "m2", model) is None  # a shared prefix is not a parent
  assert relation(tmp_path / "runs" / ".." / "models" / "m", model) == "is"
  (tmp_path / "models").mkdir()
  os.symlink(tmp_path / "models", tmp_path / "link")
  assert relation(tmp_path / "link" / "m", model) == "is"


@pytest.mark.parametrize("out, how", [("m", "is"), ("m/run", "lies inside"), (".", "contains")])
def test_a_run_folder_over_an_input_names_both_fields(tmp_path, out, how):
  model = str(tmp_path / "m")
  out = os.path.normpath(str(tmp_path / out))
  with pytest.raises(ValueError) as error:
    check_run_paths(inputs=[("C.model_path", model), ("C.eval_path", None)],
                    run_dirs=[("C.run_dir", out)])
  first = str(error.value).splitlines()[0]
  assert first.startswith(f"C.run_dir={out!r} {how} C.model_path={model!r}, which the run reads")
  assert "Give C.run_dir a path outside every folder and file the run reads" in first


def test_a_data_file_is_compared_as_itself(tmp_path):
  data = str(tmp_path / "data" / "train.jsonl")
  # A run folder beside the data file, or inside its folder, does not touch it.
  check_run_paths(inputs=[("C.train_path", data)],
                  run_dirs=[("C.run_dir", str(tmp_path / "data" / "run"))],
                  exports=[("C.export_dir", str(tmp_path / "out"))])
  with pytest.raises(ValueError, match=r"^C.export_dir='.*data' contains C.train_path="):
    check_run_paths(inputs=[("C.train_path", data)], exports=[("C.export_dir",
                                                               str(tmp_path / "data"))])


def test_an_export_may_not_hold_the_run_folder(tmp_path):
  run = str(tmp_path / "runs" / "sft")
  check_run_paths(inputs=[], run_dirs=[("C.run_dir", run)],
                  exports=[("C.export_dir", os.path.join(run, "hf_model"))])  # the default
  for export, how in ((run, "is"), (str(tmp_path / "runs"), "contains")):
    with pytest.raises(ValueError, match=rf"^C.export_dir='{export}' {how} C.run_dir='{run}': an "
                                         "export replaces its folder whole"):
      check_run_paths(inputs=[], run_dirs=[("C.run_dir", run)], exports=[("C.export_dir",
                                                                          export)])
