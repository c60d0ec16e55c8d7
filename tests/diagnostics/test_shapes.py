"""`jax_ppo.diagnostics.shapes`: the common models' architectures, without downloading anything.

Every entry builds our model abstractly (`nnx.eval_shape`) and transformers' on the meta device
from the same dict: the parameter counts agree exactly and lie within 1% of the published
figures. Then the ways a plan takes a shape as its policy (`policy_path=shape:NAME`, `--model`),
without libtpu."""

import json

import jax
import pytest
import torch
import transformers
from flax import nnx

from jax_ppo import cli, models
from jax_ppo.diagnostics import plan, ppo_plan, shapes
from jax_ppo.runs.ppo_config import load_run_config

PUBLISHED = {
    # name: (total, non-embedding), as published; None where no figure is published.
    "qwen3-0.6b": (0.6e9, 0.44e9),  # Qwen/Qwen3-0.6B model card.
    "qwen3-1.7b": (1.7e9, 1.4e9),  # Model card; 1.72e9 is 1.2% above its rounded "1.7B".
    "qwen3-4b": (4.0e9, 3.6e9),
    "qwen3-8b": (8.2e9, 6.95e9),
    "qwen2.5-7b": (7.61e9, 6.53e9),  # Qwen/Qwen2.5-7B model card.
    "llama-3.2-1b": (1.23e9, None),  # Meta's Llama 3.2 model card.
    "llama-3.2-3b": (3.21e9, None),
    "llama-3.1-8b": (8.03e9, None),  # Meta's Llama 3.1 model card.
    "gemma-2-2b": (2.61e9, 2_024_517_888),  # Model card; Gemma 2 report, table of sizes.
    "gemma-2-9b": (9.24e9, 8_324_201_984),
}
UNROUNDED = {"qwen3-1.7b": 0.015}  # The card's total is rounded to 2 digits.
EXACT_NON_EMBEDDING = ("gemma-2-2b", "gemma-2-9b")  # The report prints every digit.


def _our_count(config: models.ModelConfig) -> int:
  model = nnx.eval_shape(lambda: models.CausalLM(config, rngs=nnx.Rngs(0)))
  return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _hf_count(name: str) -> int:
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(shapes.hf_shape_config(name))
  return sum(p.numel() for p in model.parameters())


def test_the_table_has_the_promised_models_and_published_figures():
  assert set(shapes.COMMON_SHAPES) == set(PUBLISHED) == {
      "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen2.5-7b", "llama-3.2-1b",
      "llama-3.2-3b", "llama-3.1-8b", "gemma-2-2b", "gemma-2-9b"}


@pytest.mark.parametrize("name", sorted(shapes.COMMON_SHAPES))
def test_parameter_count_matches_transformers_and_the_published_figure(name):
  config = shapes.shape_config(name)
  ours = _our_count(config)
  assert ours == _hf_count(name)
  total, non_embedding = PUBLISHED[name]
  assert ours == pytest.approx(total, rel=UNROUNDED.get(name, 0.01))
  embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
  if name in EXACT_NON_EMBEDDING:
    assert ours - embeddings == non_embedding
  elif non_embedding is not None:
    assert ours - embeddings == pytest.approx(non_embedding, rel=0.01)


def test_family_switches_are_read_from_the_dict():
  qwen3, qwen2 = shapes.shape_config("qwen3-8b"), shapes.shape_config("qwen2.5-7b")
  assert (qwen3.model_type, qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim) == ("qwen3", True,
                                                                                False, 128)
  assert qwen3.rope_theta == 1e6 and qwen3.sliding_window is None
  assert qwen3.eos_token_ids == (151645,) and not qwen3.tie_word_embeddings
  assert (qwen2.qkv_bias, qwen2.out_bias, qwen2.sliding_window) == (True, False, None)
  llama = shapes.shape_config("llama-3.1-8b")
  assert llama.rope_theta == 5e5 and llama.norm_eps == 1e-5 and llama.head_dim == 128
  assert llama.rope_scaling == models.RopeScaling(rope_type="llama3", factor=8.0)
  assert shapes.shape_config("llama-3.2-1b").rope_scaling.factor == 32.0
  gemma = shapes.shape_config("gemma-2-9b")
  assert (gemma.attn_softcap, gemma.final_softcap, gemma.sliding_window) == (50.0, 30.0, 4096)
  assert gemma.query_scale == 256**-0.5 and gemma.embed_scale == 3584**0.5
  assert gemma.sliding_layers == (True, False) * 21  # Even layers slide, odd ones are global.
  assert gemma.activation == "gelu_pytorch_tanh" and gemma.sandwich_norms


def test_unknown_name_is_one_value_error_listing_the_names():
  with pytest.raises(ValueError, match="Unknown model shape 'qwen3-9b'") as e:
    shapes.shape_config("qwen3-9b")
  assert all(name in str(e.value) for name in shapes.COMMON_SHAPES)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="'nope'"):
    shapes.plan_model_config("shape:nope")


def _run_config(tmp_path, policy_path: str) -> str:
  path = tmp_path / "run.json"
  path.write_text(json.dumps({"policy_path": policy_path, "prompts_path": "prompts.txt",
                              "run_dir": str(tmp_path / "run"), "reward_function": "length"}))
  return str(path)


def test_run_shape_reads_a_shape_policy_path_and_still_reads_folders(tmp_path):
  config = load_run_config([_run_config(tmp_path, "shape:llama-3.2-3b")])
  assert ppo_plan.run_shape(config, prompt_length=100).model == shapes.shape_config(
      "llama-3.2-3b")
  folder = tmp_path / "policy"
  shapes.hf_shape_config("qwen3-0.6b").save_pretrained(folder)
  config = load_run_config([_run_config(tmp_path, str(folder))])
  model = ppo_plan.run_shape(config, prompt_length=100).model
  assert model.hidden_size == 1024 and model.num_layers == 28 and model.qk_norm


def test_cli_model_option_overrides_the_policy_path(tmp_path, monkeypatch, capsys):
  planned = []
  monkeypatch.setattr(plan, "require_compiler", lambda _: None)
  monkeypatch.setattr(ppo_plan, "plan_run", lambda shape, topo: planned.append((shape, topo)))
  monkeypatch.setattr(plan, "format_plan", lambda _: "the plan")
  run = _run_config(tmp_path, str(tmp_path / "no-such-folder"))
  assert cli.main(["plan", run, "--topology", "v5e:2x4", "--model", "gemma-2-2b"]) == 0
  assert capsys.readouterr().out == "the plan\n"
  [(shape, topo)] = planned
  assert shape.model == shapes.shape_config("gemma-2-2b") and topo == "v5e:2x4"
  assert cli.main(["plan", run, "policy_path=shape:qwen3-4b", "--topology", "v5e:2x4"]) == 0
  assert planned[-1][0].model == shapes.shape_config("qwen3-4b")
  with pytest.raises(SystemExit) as e:  # argparse: "invalid choice", the names listed
    cli.main(["plan", run, "--topology", "v5e:2x4", "--model", "gpt-5"])
  assert e.value.code == 2 and "qwen3-8b" in capsys.readouterr().err
  assert cli.main(["plan", _run_config(tmp_path, "shape:gpt-5"), "--topology", "v5e:2x4"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Unknown model shape 'gpt-5'" in err and "qwen3-8b" in err
