"""The tiny PPO run the plans' tests compile (tests/diagnostics/test_plan.py for TPU slices,
test_gpu_plan.py for GPU nodes): a Qwen3 policy with untied embeddings, and its parameter count
by hand."""

import json
import pathlib

D, F, V, H, K, DH = 128, 256, 512, 4, 2, 32
GAE = dict(batch_size=8, sampling={"max_new_tokens": 8}, ppo_epochs=2)  # fused: one minibatch


def layer_param_count() -> int:
  """One Qwen3 layer: q, k, v, o projections, the gated MLP, two norms and the q/k norms."""
  return D * H * DH + 2 * D * K * DH + H * DH * D + 3 * D * F + 2 * D + 2 * DH


def param_count(layers: int) -> int:
  """The policy (embedding and LM head untied) with a value head `[D, 1]` and its bias on the
  trunk."""
  return 2 * V * D + layers * layer_param_count() + D + (D + 1)


def write_run(root: pathlib.Path, layers: int) -> pathlib.Path:
  """The policy's `config.json` under `root/policy` and a `jax-ppo train` config data parallel
  over 4 devices (`root/run.json`, returned)."""
  import transformers

  transformers.Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=F,
                           num_hidden_layers=layers, num_attention_heads=H,
                           num_key_value_heads=K, head_dim=DH, max_position_embeddings=256,
                           tie_word_embeddings=False).save_pretrained(root / "policy")
  config = {"policy_path": str(root / "policy"), "prompts_path": "prompts.txt",
            "run_dir": str(root / "run"), "reward_function": "length", "ppo": GAE,
            "mesh": {"data": 4}}
  (root / "run.json").write_text(json.dumps(config))
  return root / "run.json"
