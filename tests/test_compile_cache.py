"""JAX's persistent compilation cache for runs (`jax_ppo.compile_cache`).

The settings ("auto", a folder, null / "off") and their validation in the run configs, and, end
to end, that a second `jax-ppo train` in a fresh process loads the programs the first compiled
instead of compiling them again.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from jax_ppo import compile_cache
from jax_ppo.runs.ppo_config import RunConfig
from jax_ppo.runs.sft import SFTRunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_enable_compilation_cache")


@pytest.fixture
def jax_cache_config(monkeypatch):
  """Restores JAX's cache settings afterwards; starts with no cache folder configured."""
  monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
  old = {k: getattr(jax.config, k) for k in KEYS}
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  cc.reset_cache()


def test_a_folder_turns_the_cache_on_there(jax_cache_config, tmp_path):
  folder = compile_cache.enable_compilation_cache(tmp_path / "cache")
  assert folder == tmp_path / "cache" and folder.is_dir()
  assert jax.config.jax_compilation_cache_dir == str(folder)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_TIME_S
  # Every program is written to the folder, however fast it compiled.
  jax.jit(lambda x: x * 3.0 + 1.0)(jax.numpy.ones(7)).block_until_ready()
  assert any(p.name.startswith("jit_") for p in folder.iterdir())


def test_auto_uses_the_env_folder_unless_jax_already_has_one(jax_cache_config, tmp_path,
                                                             monkeypatch):
  monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "env"))
  assert compile_cache.enable_compilation_cache("auto") == tmp_path / "env"
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")
  # A folder JAX was given (by the user, or the call above) is kept, settings and all.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 5.0)
  monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "other"))
  assert compile_cache.enable_compilation_cache("auto") == tmp_path / "env"
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 5.0
  assert not (tmp_path / "other").exists()


def test_default_folder(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.default_cache_dir() == tmp_path / "jax_ppo" / "xla"
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert compile_cache.default_cache_dir() == pathlib.Path.home() / ".cache" / "jax_ppo" / "xla"


def test_an_explicit_min_compile_time_wins(jax_cache_config, tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "3")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 3.0)
  compile_cache.enable_compilation_cache(tmp_path)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 3.0


@pytest.mark.parametrize("setting", [None, "off"])
def test_null_or_off_changes_nothing(jax_cache_config, setting):
  assert compile_cache.enable_compilation_cache(setting) is None
  assert jax.config.jax_compilation_cache_dir is None


@pytest.mark.parametrize("value", ["", "  ", 3, True])
def test_bad_settings_name_the_field(value, tmp_path):
  with pytest.raises(ValueError, match=r"compilation_cache_dir=.*folder path, or null"):
    compile_cache.enable_compilation_cache(value)
  with pytest.raises(ValueError, match=r"RunConfig\.compilation_cache_dir="):
    RunConfig(policy_path="p", prompts_path="q", run_dir="r", reward_function="length",
              compilation_cache_dir=value)
  with pytest.raises(ValueError, match=r"SFTRunConfig\.compilation_cache_dir="):
    SFTRunConfig(model_path="m", train_path="t", run_dir="r", compilation_cache_dir=value)


def test_the_field_may_change_when_a_run_resumes():
  from jax_ppo.runs.common import STAGE_OPERATIONAL_FIELDS
  from jax_ppo.runs.ppo_config import OPERATIONAL_FIELDS

  assert "compilation_cache_dir" in OPERATIONAL_FIELDS
  assert "compilation_cache_dir" in STAGE_OPERATIONAL_FIELDS


DRIVER = """
import json, sys
import jax
counts = {"hits": 0, "misses": 0}
def listen(event, **kwargs):
  if event == "/jax/compilation_cache/cache_hits":
    counts["hits"] += 1
  elif event == "/jax/compilation_cache/cache_misses":
    counts["misses"] += 1
jax.monitoring.register_event_listener(listen)
from jax_ppo.cli import main
status = main(sys.argv[1:])
print(json.dumps({"status": status, **counts}))
"""


@pytest.mark.slow
def test_a_second_run_in_a_fresh_process_loads_its_programs(tmp_path):
  """`jax-ppo train` with `compilation_cache_dir` twice, each in a new process, with the
  default settings otherwise: the second writes nothing new and compiles nothing (every program,
  the small helpers included, is a cache hit)."""
  from tests.tiny_hf_run import make_checkpoint, write_data

  data = write_data(tmp_path)
  policy = make_checkpoint(tmp_path, "llama")
  cache = tmp_path / "cache"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
    env.pop(name, None)

  def train(run: str) -> dict:
    args = ["train", f"policy_path={policy}", f"prompts_path={data['prompts']}",
            "reward_function=length", f"run_dir={tmp_path / run}", f"compilation_cache_dir={cache}",
            "ppo.batch_size=4", "ppo.num_minibatches=1", "ppo.ppo_epochs=2",
            "ppo.sampling.max_new_tokens=4", "ppo.total_updates=1", "run.progress=false",
            "run.tensorboard=false", "run.plots=false"]
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

  first = train("run1")
  files = sorted(p.name for p in cache.iterdir())
  assert first["status"] == 0 and first["misses"] > 0 and first["hits"] == 0
  assert any(name.startswith("jit_experience_and_update") for name in files), files
  second = train("run2")
  assert second["status"] == 0
  assert second["misses"] == 0 and second["hits"] == first["misses"], (first, second)
  assert sorted(p.name for p in cache.iterdir()) == files
