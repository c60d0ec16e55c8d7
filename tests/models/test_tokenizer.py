"""load_tokenizer: local-only loading, left padding, a pad token that is never EOS."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_ppo.models import tokenizer as tok_lib

pytest.importorskip("tokenizers", reason="tiny tokenizers are built with the `tokenizers` library")

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def _make_tokenizer(path, *, extra=(), pad=None, template=True):
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", *extra]
  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  kwargs = dict(eos_token="</s>", bos_token="<s>", unk_token="<unk>")
  if pad is not None:
    kwargs["pad_token"] = pad
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
  if template:
    fast.chat_template = TEMPLATE
  fast.save_pretrained(str(path))
  return str(path)


def _make_gpt2_like(path, *, extra=()):
  """GPT-2's special-token layout: one `<|endoftext|>` that is BOS, EOS and UNK at once."""
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = ["<|endoftext|>", "hello", "world", *extra]
  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                       unk_token="<|endoftext|>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
      unk_token="<|endoftext|>",
  )
  fast.save_pretrained(str(path))
  return str(path)


def test_llama2_and_mistral_layout_pads_with_unk(tmp_path):
  # <unk> 0, <s> 1, </s> 2 and no pad token, as Llama 2 and Mistral ship.
  path = _make_tokenizer(tmp_path)
  tokenizer = tok_lib.load_tokenizer(path)
  assert tokenizer.pad_token == "<unk>" and tokenizer.pad_token_id == 0
  assert len(tokenizer) == 8  # nothing added: the id has an embedding row
  assert tokenizer.padding_side == "left"
  enc = tokenizer(["hello", "hello world world"], padding=True, return_tensors="np")
  np.testing.assert_array_equal(enc["attention_mask"], [[0, 0, 1], [1, 1, 1]])
  np.testing.assert_array_equal(enc["input_ids"][0], [0, 0, 3])
  # An unknown word is <unk> = PAD inside the text; masks come from lengths, not from ids.
  seq = tokenizer("hello zebra")["input_ids"]
  assert seq == [3, 0]
  ids, mask = tok_lib.pad_batch([seq, [4]], pad_token_id=tokenizer.pad_token_id, length=4)
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1]])
  np.testing.assert_array_equal(ids, [[0, 0, 3, 0], [0, 0, 0, 4]])


def test_unk_is_never_a_stop_token(tmp_path):
  path = _make_tokenizer(tmp_path)
  with pytest.raises(tok_lib.PadTokenError) as err:
    tok_lib.load_tokenizer(path, extra_eos_ids=[0])  # <unk> configured as a stop id
  assert "pad_token" in str(err.value) and "resize_token_embeddings" in str(err.value)
  tokenizer = tok_lib.load_tokenizer(path, extra_eos_ids=[0], add_pad_token=True)
  assert tokenizer.pad_token == tok_lib.NEW_PAD_TOKEN and tokenizer.pad_token_id == 8


def test_gpt2_layout_is_a_clear_error_naming_both_fixes(tmp_path):
  path = _make_gpt2_like(tmp_path)
  with pytest.raises(tok_lib.PadTokenError) as err:
    tok_lib.load_tokenizer(path)
  message = str(err.value)
  assert isinstance(err.value, ValueError)
  for part in ("<|endoftext|>", path, "pad_token", "add_pad_token=True",
               "resize_token_embeddings(model, len(tokenizer))", "resize_embeddings=true"):
    assert part in message, part
  # Fix 1: a configured existing token. Fix 2: a new token (test_adds_a_new_pad_token_...).
  assert tok_lib.load_tokenizer(path, pad_token="world").pad_token_id == 2
  with pytest.raises(tok_lib.PadTokenError, match="not in the vocabulary"):
    tok_lib.load_tokenizer(path, pad_token="<pad>")
  assert tok_lib.load_tokenizer(path, pad_token="<pad>", add_pad_token=True).pad_token_id == 3
  # A reward model's tokenizer only pads masked slots: it may stay without a pad token.
  lenient = tok_lib.load_tokenizer(path, require_pad=False)
  assert lenient.pad_token is None and len(lenient) == 3


def test_adds_a_new_pad_token_when_none_fits(tmp_path):
  """Only when asked (add_pad_token=True); the model then needs resize_token_embeddings."""
  path = _make_gpt2_like(tmp_path)
  tokenizer = tok_lib.load_tokenizer(path, add_pad_token=True)
  assert tokenizer.pad_token == tok_lib.NEW_PAD_TOKEN
  assert tokenizer.pad_token_id == 3 and len(tokenizer) == 4  # one id past the old vocabulary
  assert tokenizer.pad_token_id != tokenizer.eos_token_id
  enc = tokenizer(["hello", "hello world world"], padding=True, return_tensors="np")
  np.testing.assert_array_equal(enc["attention_mask"], [[0, 0, 1], [1, 1, 1]])
  np.testing.assert_array_equal(enc["input_ids"][0], [3, 3, 1])
  # A tokenizer whose existing tokens fit never grows, even when adding is allowed.
  assert len(tok_lib.load_tokenizer(_make_tokenizer(tmp_path / "l2"), add_pad_token=True)) == 8


def test_reuses_an_existing_unused_special_token(tmp_path):
  path = _make_tokenizer(
      tmp_path, extra=["<|reserved_special_token_3|>", "<|finetune_right_pad_id|>"], pad="</s>"
  )
  tokenizer = tok_lib.load_tokenizer(path)
  assert tokenizer.pad_token == "<|finetune_right_pad_id|>"
  assert len(tokenizer) == 10  # Nothing was added.


def test_reserved_token_fallback_and_extra_eos(tmp_path):
  path = _make_tokenizer(tmp_path, extra=["<|reserved_special_token_1|>"])
  tokenizer = tok_lib.load_tokenizer(path)
  assert tokenizer.pad_token == "<|reserved_special_token_1|>"
  # A pad that is one of the model's extra stop ids is replaced (here by <unk>).
  path2 = _make_tokenizer(tmp_path / "b", extra=["<pad>"], pad="<pad>")
  tokenizer = tok_lib.load_tokenizer(path2, extra_eos_ids=[8])
  assert tokenizer.pad_token == "<unk>"


def test_forced_pad_token_cannot_be_eos(tmp_path):
  path = _make_tokenizer(tmp_path)
  with pytest.raises(tok_lib.PadTokenError, match="EOS"):
    tok_lib.load_tokenizer(path, pad_token="</s>")
  with pytest.raises(tok_lib.PadTokenError, match="stop"):
    tok_lib.load_tokenizer(path, pad_token="hello", extra_eos_ids=[3])


def test_chat_template_and_padding(tmp_path):
  path = _make_tokenizer(tmp_path)
  tokenizer = tok_lib.load_tokenizer(path)
  conversations = [
      [{"role": "user", "content": "hello world"}], [{"role": "user", "content": "hello"}]
  ]
  encoded = tok_lib.encode_chat(tokenizer, conversations)
  assert encoded[0] == [5, 7, 3, 4, 6, 7]
  ids, mask = tok_lib.pad_batch(encoded, pad_token_id=tokenizer.pad_token_id, length=8)
  assert ids.shape == (2, 8)
  np.testing.assert_array_equal(mask[1], [0, 0, 0, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(ids[1, :3], [0, 0, 0])
  no_template = _make_tokenizer(tmp_path / "nt", template=False)
  with pytest.raises(ValueError, match="chat template"):
    tok_lib.encode_chat(tok_lib.load_tokenizer(no_template), conversations)
  custom = tok_lib.load_tokenizer(no_template, chat_template=TEMPLATE)
  assert tok_lib.encode_chat(custom, conversations) == encoded


def test_check_vocab_covers(tmp_path):
  from jax_ppo.models.config import ModelConfig

  tokenizer = tok_lib.load_tokenizer(_make_tokenizer(tmp_path), add_pad_token=True,
                                     extra_eos_ids=[0])
  small = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=8)
  with pytest.raises(tok_lib.VocabularyError, match="9 tokens.*resize_token_embeddings"):
    tok_lib.check_vocab_covers(tokenizer, small)
  tok_lib.check_vocab_covers(tokenizer, dataclasses.replace(small, vocab_size=9))
