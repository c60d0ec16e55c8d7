"""The pad-token trap through `build_trainer` (the CLI path): a GPT-2-style tokenizer without a
usable pad token is one clear error naming the fixes; `pad_token=` reuses an existing token;
`resize_embeddings=true` adds `<|pad|>` and grows the policy and the reward model (and so the
critic copied from it), and training on the grown models stays finite."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from jax_ppo.models import PadTokenError  # noqa: E402
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling  # noqa: E402
from jax_ppo.runs import ppo as run  # noqa: E402
from jax_ppo.runs import ppo_config as run_config  # noqa: E402
from jax_ppo.runs.common import PPORunFolder  # noqa: E402

WORDS = "the movie was good bad very fun dull plot and it".split()
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """GPT-2 policy and reward folders whose tokenizer, like GPT-2's, has only <|endoftext|>."""
  root = tmp_path_factory.mktemp("pad")
  vocab = {w: i for i, w in enumerate([EOT, *WORDS])}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=EOT))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT,
                                             eos_token=EOT, unk_token=EOT)
  config = transformers.GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2,
                                   n_positions=32, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(config).save_pretrained(root / "policy")
  tok.save_pretrained(root / "policy")
  config.num_labels = 1
  config.pad_token_id = 0
  transformers.GPT2ForSequenceClassification(config).save_pretrained(root / "reward")
  tok.save_pretrained(root / "reward")
  (root / "prompts.txt").write_text("the movie was\nit was very\nthe plot\na fun movie\n")
  return root


def _config(root, **kwargs):
  ppo = dict(batch_size=4, num_minibatches=1, ppo_epochs=1,
             sampling=PPOSampling(max_new_tokens=4), total_updates=2,
             optimizer=PPOOptimizer(learning_rate=1e-3))
  return run_config.RunConfig(
      policy_path=str(root / "policy"), reward_model_path=str(root / "reward"),
      prompts_path=str(root / "prompts.txt"), run_dir=str(root / kwargs.pop("name", "run")),
      run=PPORunFolder(progress=False, tensorboard=False), ppo=PPOConfig(**ppo), **kwargs,
  )


def test_no_pad_token_is_one_error_naming_the_fixes(folders):
  with pytest.raises(PadTokenError) as err:
    run.build_trainer(_config(folders), open_run=False)
  message = str(err.value)
  for part in (str(folders / "policy"), EOT, "pad_token", "resize_embeddings=true"):
    assert part in message, part
  with pytest.raises(ValueError, match="RunConfig.resize_embeddings"):
    _config(folders, resize_embeddings="yes")


def test_configured_existing_pad_token_needs_no_resize(folders):
  trainer = run.build_trainer(_config(folders, pad_token="and"), open_run=False)
  try:
    assert trainer.config.sampling.pad_token_id == 1 + WORDS.index("and")
    assert trainer.config.sampling.stop_token_ids == (0,)
    assert trainer.sampler.model_config.vocab_size == 1 + len(WORDS)
  finally:
    trainer.close()
  with pytest.raises(PadTokenError, match="stop"):
    run.build_trainer(_config(folders, pad_token=EOT), open_run=False)


def test_resize_embeddings_grows_policy_reward_and_critic_and_trains(folders):
  v = 1 + len(WORDS)
  trainer = run.build_trainer(_config(folders, resize_embeddings=True, name="resized"))
  try:
    assert trainer.tokenizer.pad_token == "<|pad|>" and trainer.config.sampling.pad_token_id == v
    assert trainer.sampler.model_config.vocab_size == v + 1
    reward_embed = trainer.frozen.reward["decoder"]["embed"]["embedding"]
    assert reward_embed.shape[0] == v + 1
    metrics = trainer.train(2)
    assert len(metrics) == 2
    for record in metrics:
      assert all(np.isfinite(x) for x in record.values() if isinstance(x, float)), record
    leaves = jax.tree.leaves(trainer.state)
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves
               if np.issubdtype(np.asarray(x).dtype, np.floating))
  finally:
    trainer.close()
  # The checkpoint restores into the grown model, and the export loads in transformers with
  # a tokenizer and an embedding of the same size.
  out, step = run.export_run(folders / "resized", folders / "exported")
  assert step == 2
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert hf_tok.pad_token == "<|pad|>" and len(hf_tok) == v + 1
  assert hf.get_input_embeddings().weight.shape[0] == v + 1
  with torch.no_grad():
    logits = hf(torch.tensor([[v, 1, 2]]), attention_mask=torch.tensor([[0, 1, 1]])).logits
  assert torch.isfinite(logits).all()
