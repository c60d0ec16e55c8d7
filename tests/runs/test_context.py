"""`jax_ppo.runs.context`: lengths checked against the model's context before any weights load.

`sft.max_length` and `reward.max_length` past the starting model's `max_position_embeddings`,
`normalise_max_new_tokens` that leaves no room for a prompt, and (`jax-ppo eval`) the run's
`max_new_tokens` or a held-out prompt that does not fit are one error naming the field, both
numbers and the fix, through the Python API and the command line; a refused run changes no file
of its model, data or run folders (hashed before and after) and loads no weights.
"""

import dataclasses
import pathlib

import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
pytest.importorskip("transformers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.config_io import save_config  # noqa: E402
from jax_ppo.models import load_config  # noqa: E402
from jax_ppo.runs import ppo, reward, sft  # noqa: E402
from jax_ppo.runs.context import check_fits_context, prompt_token_budget  # noqa: E402
from jax_ppo.runs.ppo_config import load_run_config  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, tree_hashes, write_data  # noqa: E402

CONTEXT = 64  # the tiny models' max_position_embeddings (tests.tiny_hf_run.FAMILIES)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("context")
  return {"root": root, "model": make_checkpoint(root, "llama"), **write_data(root)}


def test_check_fits_context_names_field_numbers_and_fix(assets):
  config = load_config(assets["model"])
  check_fits_context("C.sft.max_length", CONTEXT, config, model_field="C.model_path",
                     model_path="m")  # exactly the context fits
  with pytest.raises(ValueError) as error:
    check_fits_context("C.sft.max_length", CONTEXT + 1, config, model_field="C.model_path",
                       model_path="m")
  assert str(error.value) == (
      f"C.sft.max_length={CONTEXT + 1} is longer than the context of C.model_path='m' "
      f"(max_position_embeddings={CONTEXT} in its config.json): rows past it would attend beyond "
      f"the positions the model was trained on; lower sft.max_length to {CONTEXT} or less (the "
      "model uses RoPE: if it handles longer sequences, raise max_position_embeddings in its "
      "config.json deliberately).")
  learned = dataclasses.replace(config, position_embedding="learned")
  with pytest.raises(ValueError, match="learned position table has exactly that many rows"):
    check_fits_context("C.max_length", CONTEXT + 1, learned, model_field="C.model_path",
                       model_path="m")


def test_prompt_token_budget(assets):
  config = load_config(assets["model"])
  assert prompt_token_budget(config, 4) == CONTEXT - 4
  assert prompt_token_budget(config, CONTEXT - 1) == 1
  with pytest.raises(ValueError, match=rf"^X.max_new_tokens={CONTEXT} leaves no room for a "
                                       rf"prompt in the policy's context of {CONTEXT} tokens; "
                                       r"lower it\.$"):
    prompt_token_budget(config, CONTEXT, field="X.max_new_tokens", fix="lower it")


SFT = ["dtype=float32", "sft.batch_size=4", "run.progress=false", "run.tensorboard=false"]
REWARD = ["dtype=float32", "reward.batch_size=4", "reward.total_steps=2", "run.progress=false"]


@pytest.mark.parametrize("stage, extra, first", [
    ("sft", [f"sft.max_length={CONTEXT + 1}"],
     f"SFTRunConfig.sft.max_length={CONTEXT + 1} is longer than the context of "
     "SFTRunConfig.model_path='MODEL' (max_position_embeddings=64 in its config.json)"),
    ("sft", ["sft.max_length=4096", "sft.packing=true"],
     "SFTRunConfig.sft.max_length=4096 is longer than the context of SFTRunConfig.model_path="),
    ("reward", [f"reward.max_length={CONTEXT * 2}"],
     f"RewardRunConfig.reward.max_length={CONTEXT * 2} is longer than the context of "
     "RewardRunConfig.model_path='MODEL' (max_position_embeddings=64 in its config.json)"),
    ("reward", ["reward.max_length=16", f"normalise_max_new_tokens={CONTEXT}"],
     f"RewardRunConfig.normalise_max_new_tokens={CONTEXT} leaves no room for a prompt in the "
     f"policy's context of {CONTEXT} tokens; lower normalise_max_new_tokens."),
])
def test_stage_lengths_past_the_context_are_refused_before_loading(
    stage, extra, first, assets, tmp_path, capsys, no_weights):
  first = first.replace("MODEL", assets["model"])
  run_dir = tmp_path / "run"
  data = assets["sft"] if stage == "sft" else assets["prefs"]
  argv = [f"model_path={assets['model']}", f"train_path={data}", f"run_dir={run_dir}",
          *(SFT if stage == "sft" else REWARD), *extra]
  before = tree_hashes(assets["root"])
  # The command line: one line, exit status 2.
  assert main([stage, *argv]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1, err
  assert err.startswith(f"jax-ppo {stage}: error: {first}"), err
  # The Python API: the same error from the run function.
  with pytest.raises(ValueError) as error:
    if stage == "sft":
      sft.run_sft(sft.load_sft_config(argv))
    else:
      reward.run_reward(reward.load_reward_config(argv))
  assert str(error.value).splitlines()[0].startswith(first)
  assert tree_hashes(assets["root"]) == before and not run_dir.exists()


def _ppo_run_folder(assets, run_dir, *overrides) -> pathlib.Path:
  """A PPO run folder as the run loop leaves it before its first checkpoint (its config.yaml)."""
  config = load_run_config([
      f"policy_path={assets['model']}", f"prompts_path={assets['prompts']}",
      "reward_function=length", f"run_dir={run_dir}", *overrides])
  run_dir.mkdir()
  save_config(config, run_dir)
  return run_dir


def test_eval_refuses_prompts_and_max_new_tokens_past_the_context(assets, tmp_path, capsys,
                                                                  no_weights):
  run_dir = _ppo_run_folder(assets, tmp_path / "run", f"ppo.sampling.max_new_tokens={CONTEXT}")
  before = tree_hashes(assets["root"], run_dir)
  assert main(["eval", "--run-dir", str(run_dir), "--prompts", assets["prompts"]]) == 2
  err = capsys.readouterr().err
  assert err.startswith(
      f"jax-ppo eval: error: PPOConfig.sampling.max_new_tokens={CONTEXT} leaves no room for a "
      f"prompt in the policy's context of {CONTEXT} tokens; the run in {str(run_dir)!r} was "
      "trained with it"), err
  # A held-out prompt longer than the context minus max_new_tokens (60): its file and line.
  run_dir = _ppo_run_folder(assets, tmp_path / "run4", "ppo.sampling.max_new_tokens=4")
  long = tmp_path / "heldout.txt"
  long.write_text("the movie\n" + "very " * (CONTEXT - 3) + "\n")
  before.update(tree_hashes(run_dir))
  with pytest.raises(ValueError) as error:
    ppo.evaluate_run(run_dir, long)
  assert str(error.value).startswith(
      f"--prompts={str(long)!r}, line 2: the prompt has {CONTEXT - 3} tokens, more than the "
      f"{CONTEXT - 4} that fit"), error.value
  assert str(error.value).endswith("; shorten it (the run's ppo.sampling.max_new_tokens is fixed "
                                   "by its training)."), error.value
  assert tree_hashes(assets["root"], tmp_path / "run", run_dir) == before
  assert not (run_dir / "eval").exists()
