"""Multi-turn chats in SFT (jax_ppo.data.sft): every assistant turn is a target and the user
turns between them are context (`assistant_turns="all"`), or only the last turn is (`"last"`);
the masks survive truncation and packing, and reach the trainer's loss."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ppo.data.sft import SFTExample, chat_segments, encode_record, pack_examples, pad_examples
from jax_ppo.models.transformer import CausalLM
from jax_ppo.sft import SFTConfig, SFTTrainer
from tests.ppo.conftest import MODEL

pytest.importorskip("tokenizers")

WORDS = ["<pad>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "good", "[old]"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
EOS = 2


@pytest.fixture(scope="module")
def tok():
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  out = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="</s>", bos_token="<s>", pad_token="<pad>")
  out.chat_template = TEMPLATE
  return out


def _turn(role, content):
  return {"role": role, "content": content}


CHAT = [_turn("user", "hello"), _turn("assistant", "good world"), _turn("user", "world"),
        _turn("assistant", "good")]


def test_every_assistant_turn_is_a_target_and_user_turns_are_context(tok):
  ex = encode_record({"messages": CHAT}, tok)
  assert ex.prompt_ids == (5, 7, 3, 6, 7)  # "user : hello assistant :"
  # "good world" | "user : world assistant :" | "good" + EOS
  assert ex.response_ids == (8, 4, 5, 7, 4, 6, 7, 8, EOS)
  assert ex.response_mask == (True, True, False, False, False, False, False, True, True)
  last = encode_record({"messages": CHAT}, tok, assistant_turns="last")
  assert last == SFTExample((5, 7, 3, 6, 7, 8, 4, 5, 7, 4, 6, 7), (8, EOS))
  assert last.prompt_ids + last.response_ids == ex.prompt_ids + ex.response_ids
  # One assistant turn: both settings give the unmasked example of before.
  one = {"messages": CHAT[:2]}
  assert encode_record(one, tok) == encode_record(one, tok, assistant_turns="last") == (
      SFTExample((5, 7, 3, 6, 7), (8, 4, EOS)))
  rows = pad_examples([ex], max_length=16)
  # Slot j carries loss when token j + 1 is a target: the two assistant turns and EOS.
  assert rows.targets[0][rows.loss_mask[0]].tolist() == [8, 4, 8, EOS]
  assert np.flatnonzero(rows.loss_mask[0]).tolist() == [4, 5, 11, 12]


_word = st.sampled_from(["hello", "world", "good"])
_text = st.lists(_word, min_size=1, max_size=3).map(" ".join)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(_text, _text), min_size=1, max_size=4), st.booleans())
def test_targets_are_exactly_the_assistant_turns(tok, exchanges, pack):
  """Property: the tokens that carry loss are the assistant turns' words and their end-of-turn
  text, in order, then EOS; packed beside another example, the same."""
  chat = [t for user, answer in exchanges
          for t in (_turn("user", user), _turn("assistant", answer))]
  ex = encode_record({"messages": chat}, tok)
  want = [WORDS.index(w) for _, answer in exchanges for w in answer.split()] + [EOS]
  other = encode_record({"messages": chat[:2]}, tok)
  build = pack_examples if pack else pad_examples
  rows = build([other, ex], max_length=64)
  r = 0 if pack else 1
  trained = rows.targets[r][rows.loss_mask[r]].tolist()
  first = len(other.response_ids) if pack else 0
  assert trained[first:] == want
  words = tok.apply_chat_template(chat, tokenize=False).split()
  assert list(ex.prompt_ids + ex.response_ids) == [WORDS.index(w) for w in words] + [EOS]


def test_truncation_cuts_the_mask_with_the_response(tok, caplog):
  ex = encode_record({"messages": CHAT}, tok)
  rows = pad_examples([ex], max_length=9)  # prompt 5 + "good world user :"
  assert rows.input_ids[0].tolist() == [5, 7, 3, 6, 7, 8, 4, 5, 7]
  assert rows.targets[0][rows.loss_mask[0]].tolist() == [8, 4]
  assert "responses were cut" in caplog.text
  with pytest.raises(ValueError, match=r"Example 1 has a response_mask of 2 flags \(1 True\) for "
                                       r"3 response tokens"):
    pad_examples([ex, SFTExample((3,), (4, 4, EOS), (True, False))], max_length=16)
  with pytest.raises(ValueError, match=r"at least one True"):
    pad_examples([SFTExample((3,), (4,), (False,))], max_length=16)


def test_a_template_that_renders_the_last_turn_apart(tok):
  """Templates such as Qwen3's render the last assistant turn differently (an empty reasoning
  block) from the same turn followed by more: an earlier turn then ends where the next turn's
  own template starts. A template that cannot be split that way either is refused under "all",
  naming "last", which still works."""
  original = tok.chat_template
  try:
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {% if m['role'] == 'assistant' and loop.last "
        "%}[old] {% endif %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")
    ex = encode_record({"messages": CHAT}, tok)
    assert ex.response_ids == (8, 4, 5, 7, 4, 6, 7, 9, 8, EOS)  # the last turn has its "[old]"
    assert ex.response_mask == (True, True, False, False, False, False, False, True, True, True)
    # A lone message renders with a "<s>" first: the earlier turn cannot be separated.
    tok.chat_template = "{% if messages|length == 1 %}<s> {% endif %}" + tok.chat_template
    with pytest.raises(ValueError, match=r"^r: .* turns before assistant turn 1 .* cannot be "
                                         r"separated .* or train on the last turn only "
                                         r"\(assistant_turns=\"last\"\)\.$"):
      encode_record({"messages": CHAT}, tok, where="r")
    assert encode_record({"messages": CHAT}, tok, assistant_turns="last").response_ids == (
        9, 8, EOS)
    with pytest.raises(ValueError, match=r"assistant_turns='first' is invalid"):
      chat_segments(CHAT, tok, "r", assistant_turns="first")
  finally:
    tok.chat_template = original


def test_sft_config_chooses_the_trained_turns(tok):
  with pytest.raises(ValueError, match=r"SFTConfig.assistant_turns='every' is invalid: use one "
                                       r"of \['all', 'last'\]"):
    SFTConfig(assistant_turns="every")
  config = SFTConfig(max_length=16, batch_size=1, total_steps=1)
  masks = {}
  for turns in ("all", "last"):
    trainer = SFTTrainer(dataclasses.replace(config, assistant_turns=turns),
                         CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=[{"messages": CHAT}],
                         tokenizer=tok)
    masks[turns] = trainer.train_rows.targets[0][trainer.train_rows.loss_mask[0]].tolist()
  assert masks == {"all": [8, 4, 8, EOS], "last": [8, EOS]}


def test_conversational_prompt_and_completion_train_the_completion_only(tok):
  """TRL's conversational prompt-completion records: the prompt's assistant turns are context."""
  record = {"prompt": CHAT[:3], "completion": CHAT[3:]}
  ex = encode_record(record, tok, response_field="completion")
  assert ex == encode_record({"messages": CHAT}, tok, assistant_turns="last")
  assert encode_record({"prompt": CHAT[:1], "response": CHAT[1:]}, tok) == encode_record(
      {"messages": CHAT}, tok)  # every turn of a multi-turn completion
  with pytest.raises(ValueError, match=r'^r: "prompt" is a chat but "response" is not; '
                                       r"give both as chats"):
    encode_record({"prompt": CHAT[:1], "response": "good"}, tok, where="r")
  with pytest.raises(ValueError, match=r'^r: "response" is an empty chat'):
    encode_record({"prompt": CHAT[:1], "response": []}, tok, where="r")
  with pytest.raises(ValueError, match=r"the last message of \"response\" has role 'user'"):
    encode_record({"prompt": CHAT[:1], "response": CHAT[1:3]}, tok, where="r")


# Templates in the shape of two real families (ChatML): Qwen2.5's adds a default system turn;
# Qwen3's renders the last assistant turn with an empty reasoning block. EOS is "<|im_end|>".
CHATML_WORDS = ["<pad>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "system", "user",
                "assistant", "hello", "world", "good", "helpful"]
QWEN25 = ("{%- if messages[0].role != 'system' %}<|im_start|>system\nhelpful<|im_end|>\n"
          "{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")
QWEN3 = ("{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
         "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m.content }}<|im_end|>\n{% else %}"
         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, last_turn", [
    (QWEN25, ["good", "<|im_end|>"]),
    (QWEN3, ["<think>", "</think>", "good", "<|im_end|>"]),
], ids=["qwen2.5", "qwen3"])
def test_chatml_templates_train_each_assistant_turn_to_its_end_marker(template, last_turn):
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(CHATML_WORDS)},
                                       unk_token="<pad>"))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  chatml = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>",
      additional_special_tokens=["<|im_start|>"])
  chatml.chat_template = template
  ex = encode_record({"messages": CHAT}, chatml)
  rows = pad_examples([ex], max_length=48)
  trained = [CHATML_WORDS[t] for t in rows.targets[0][rows.loss_mask[0]]]
  assert trained == ["good", "world", "<|im_end|>", *last_turn]  # EOS already ends the turn
  full = chatml.apply_chat_template(CHAT, tokenize=False)
  assert [CHATML_WORDS[t] for t in ex.prompt_ids + ex.response_ids] == [
      w if w in CHATML_WORDS else "<pad>" for w in full.replace("<|im_start|>", " <|im_start|> ")
      .replace("<|im_end|>", " <|im_end|> ").split()]
