"""Greedy decoding of the compiled sampler equals Hugging Face `generate`, token for token."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch (CPU wheel: pip install torch==2.13.0) is needed for HF parity tests"
)
transformers = pytest.importorskip("transformers")

import jax_ppo.models as models  # noqa: E402
from jax_ppo.rollout.config import SamplingConfig  # noqa: E402
from jax_ppo.rollout.sampler import Sampler  # noqa: E402

VOCAB, EOS, PAD = 96, 2, 0


def _hf_model(kind: str):
  common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
  if kind == "gpt2":
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
    model = transformers.GPT2LMHeadModel(config)
  else:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **common,
    )
    model = transformers.LlamaForCausalLM(config)
  torch.manual_seed(0)
  with torch.no_grad():  # Larger weights than the default init, so greedy paths are not flat.
    for name, p in model.named_parameters():
      if "norm" in name or "ln_" in name:
        continue
      p.normal_(0.0, 0.3)
  return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_equals_hf_generate(kind, tmp_path):
  hf = _hf_model(kind)
  hf.save_pretrained(tmp_path)
  model = models.from_pretrained(str(tmp_path))
  prompts = [[5, 17, 33, 8], [40, 41], [7, 9, 11, 13, 15, 17], [60]]
  new_tokens = 12
  cfg = SamplingConfig(
      max_new_tokens=new_tokens, greedy=True, stop_token_ids=(EOS,), pad_token_id=PAD,
      prompt_buckets=(8,), batch_buckets=(4,),
  )
  rollout = Sampler(model, cfg)(prompts, jax.random.PRNGKey(0))

  ids = np.asarray(rollout.prompt_ids)
  mask = np.asarray(rollout.prompt_mask)
  with torch.no_grad():
    out = hf.generate(
        input_ids=torch.tensor(ids, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
    )
  hf_new = out[:, ids.shape[1] :].numpy()
  ours = np.asarray(rollout.response_ids)[:, : hf_new.shape[1]]
  np.testing.assert_array_equal(ours, hf_new)
  # Variety check: the comparison is not between constant sequences.
  assert len({tuple(r) for r in ours}) > 1
