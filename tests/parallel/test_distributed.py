"""Tests of jax_ppo.parallel.distributed in one process: the config's validation, when "auto"
joins a job, the per-process key and that non-zero processes write no logs. The real two-process
run is tests/diagnostics/test_scale_check_processes.py."""

from __future__ import annotations

import signal

import jax
import pytest

from jax_ppo.logging import MetricsLogger
from jax_ppo.parallel import distributed
from jax_ppo.parallel.distributed import DistributedConfig, distributed_environment, initialize


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "maybe"}, r"DistributedConfig.mode='maybe' is invalid: choose one of"),
    ({"coordinator_address": "10.0.0.2"}, r"coordinator_address='10.0.0.2' is invalid: give "
                                          r'"host:port"'),
    ({"coordinator_address": "h:99999"}, r"coordinator_address='h:99999' is invalid"),
    ({"num_processes": 0}, r"num_processes=0 is invalid: use an int >= 1"),
    ({"num_processes": True}, r"num_processes=True is invalid"),
    ({"process_id": -1}, r"process_id=-1 is invalid: use an int >= 0"),
    ({"num_processes": 2, "process_id": 2}, r"process_id=2 is invalid: it must be below "
                                            r"num_processes=2"),
    ({"local_device_ids": ()}, r"local_device_ids=\(\) is invalid"),
    ({"local_device_ids": (0, -1)}, r"local_device_ids=\(0, -1\) is invalid"),
    ({"initialization_timeout": 0}, r"initialization_timeout=0 is invalid"),
    ({"mode": "off", "num_processes": 2}, r"mode='off' is invalid: it is 'off' but"),
])
def test_bad_configs_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    DistributedConfig(**kwargs)


def test_good_configs():
  config = DistributedConfig(coordinator_address="[::1]:1234", num_processes=4, process_id=3,
                             local_device_ids=(0, 1))
  assert config.explicit and not DistributedConfig().explicit
  assert DistributedConfig(coordinator_address="node-0.cluster:8476").explicit


@pytest.mark.parametrize("environ, source", [
    ({}, None),
    ({"JAX_PPO_DISTRIBUTED": "1"}, "JAX_PPO_DISTRIBUTED"),
    ({"JAX_PPO_DISTRIBUTED": "0"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1"}, "JAX_COORDINATOR_ADDRESS"),
    ({"SLURM_NTASKS": "1"}, None),
    ({"SLURM_NTASKS": "16"}, "SLURM_NTASKS"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE"),
])
def test_distributed_environment(environ, source):
  assert distributed_environment(environ) == source


def test_single_process_runs_do_not_initialize(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  assert initialize(DistributedConfig(), environ={}) is False
  assert initialize(DistributedConfig(mode="off"), environ={"SLURM_NTASKS": "4"}) is False
  assert calls == []


def test_initialize_passes_the_config_and_the_environment(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  config = DistributedConfig(coordinator_address="127.0.0.1:5555", num_processes=2,
                             process_id=1, local_device_ids=(1,))
  assert initialize(config, environ={}) is True
  assert calls[-1] == {"coordinator_address": "127.0.0.1:5555", "num_processes": 2,
                       "process_id": 1, "local_device_ids": [1], "initialization_timeout": 300}
  assert initialize(DistributedConfig(), environ={"JAX_PPO_DISTRIBUTED": "1"}) is True
  assert calls[-1]["coordinator_address"] is None  # left to JAX's own detection (TPU metadata)
  assert initialize(DistributedConfig(mode="on"), environ={}) is True and len(calls) == 3


def test_initialize_is_idempotent_and_checks_the_running_job(monkeypatch):
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("called again"))
  assert initialize(DistributedConfig(num_processes=1, process_id=0)) is True
  with pytest.raises(ValueError, match="num_processes=2 but jax.distributed is already "
                                       "initialized with num_processes=1"):
    initialize(DistributedConfig(num_processes=2, process_id=0))


def test_too_late_is_one_clear_error(monkeypatch):
  def late(**kw):
    raise RuntimeError("jax.distributed.initialize() must be called before any JAX calls")
  monkeypatch.setattr(jax.distributed, "initialize", late)
  with pytest.raises(ValueError, match="must be initialized before any JAX computation"):
    initialize(DistributedConfig(mode="on"))


def test_single_process_helpers():
  key = jax.random.key(3)
  assert distributed.is_main_process() and not distributed.multi_process()
  assert jax.random.key_data(distributed.process_key(key)).tolist() == jax.random.key_data(
      jax.random.fold_in(key, 0)).tolist()
  assert distributed.preemption_notice(5) is None  # no jax.distributed: the signal handlers act


def test_preemption_notice_follows_the_sync_point(monkeypatch):
  from jax.experimental import multihost_utils

  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda s: s == 7)
  assert distributed.preemption_notice(6) is None
  assert distributed.preemption_notice(7) == signal.SIGTERM


def test_other_processes_write_no_logs(tmp_path):
  with MetricsLogger(tmp_path / "run", write=False, tensorboard=True) as log:
    log.log(1, {"a": 1.0})
    log.log_samples(1, ["p"], ["r"], [0.5])
    log.flush()
  assert not (tmp_path / "run").exists()
  with MetricsLogger(tmp_path / "run0", tensorboard=False) as log:  # process 0 (the default)
    log.log(1, {"a": 1.0})
  assert (tmp_path / "run0" / "metrics.jsonl").read_text().strip() == '{"step": 1, "a": 1.0}'


@pytest.mark.parametrize("command", ["train", "sft", "reward", "dpo"])
def test_the_cli_joins_before_training(monkeypatch, capsys, command):
  """`jax-ppo train|sft|reward|dpo` hand the config's `distributed` to `initialize` first."""
  from jax_ppo import cli
  from jax_ppo.runs import dpo as dpo_run
  from jax_ppo.runs import ppo as run
  from jax_ppo.runs import reward as reward_run
  from jax_ppo.runs import sft as sft_run

  calls = []
  monkeypatch.setattr(distributed, "initialize", lambda config: calls.append(("init", config)))
  fake = {"run_training": (run, "run_training", lambda config: calls.append(("train",)) or []),
          "sft": (sft_run, "run_sft", lambda config: calls.append(("train",)) or {}),
          "reward": (reward_run, "run_reward", lambda config: calls.append(("train",)) or {}),
          "dpo": (dpo_run, "run_dpo", lambda config: calls.append(("train",)) or {})}
  module, name, fn = fake["run_training" if command == "train" else command]
  monkeypatch.setattr(module, name, fn)
  given = {"train": ["policy_path=p", "prompts_path=q", "run_dir=r", "reward_function=length"],
           "sft": ["model_path=m", "train_path=t.jsonl", "run_dir=r"],
           "reward": ["model_path=m", "train_path=t.jsonl", "run_dir=r"],
           "dpo": ["model_path=m", "train_path=t.jsonl", "run_dir=r"]}[command]
  argv = [command, *given, "distributed.coordinator_address=10.1.2.3:7777",
          "distributed.num_processes=4", "distributed.process_id=2"]
  assert cli.main(argv) == 0, capsys.readouterr().err
  assert [c[0] for c in calls] == ["init", "train"]
  assert calls[0][1] == DistributedConfig(coordinator_address="10.1.2.3:7777", num_processes=4,
                                          process_id=2)
