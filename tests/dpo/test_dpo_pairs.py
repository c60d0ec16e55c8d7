"""`jax_ppo.dpo.pairs`: the reward-model stage's record forms (text, chat with an explicit or an
implicit prompt, token ids) give the pairs with the response tokens marked; truncation keeps the
response's start and the prompt's end; errors name the record."""

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from jax_ppo.dpo import PairEncoder, dpo_pairs  # noqa: E402
from tests.tiny_hf_run import tokenizer  # noqa: E402


def encoder(tok=None, max_length=32, add_eos=True):
  return PairEncoder(tok, vocab_size=40, max_length=max_length, eos_token_id=1, add_eos=add_eos,
                     fields=("prompt", "chosen", "rejected"))


def test_chat_forms_and_text_give_the_same_response_tokens():
  tok = tokenizer()
  tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
  turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
  user = [turn("user", "the movie was")]
  explicit = {"prompt": user, "chosen": [turn("assistant", "good fun")],
              "rejected": [turn("assistant", "dull")]}
  implicit = {"chosen": user + explicit["chosen"], "rejected": user + explicit["rejected"]}
  text = {"prompt": "the movie was", "chosen": "good fun", "rejected": "dull"}
  enc = encoder(tok)
  pairs = [enc.encode([r], name="d", pad_token_id=0) for r in (explicit, implicit, text)]
  np.testing.assert_array_equal(pairs[0].chosen_ids, pairs[1].chosen_ids)
  np.testing.assert_array_equal(pairs[0].rejected_response, pairs[1].rejected_response)
  good = tok("good fun", add_special_tokens=False)["input_ids"]
  for p in pairs:
    response = p.chosen_ids[0][p.chosen_response[0] > 0].tolist()
    assert response == [*good, tok.eos_token_id]  # the template's trailing text ends at EOS
    assert p.chosen_response[0, 0] == 0 and p.chosen_mask[0].sum() > len(response)


def test_truncation_keeps_the_response_start_and_the_prompt_end():
  enc = encoder(max_length=6, add_eos=False)
  assert enc.fit(*enc.side([3, 4, 5, 6], [7, 8], "r", "chosen")) == ([3, 4, 5, 6], [7, 8])
  assert enc.fit(*enc.side([3, 4, 5, 6, 9], [7, 8], "r", "chosen")) == ([4, 5, 6, 9], [7, 8])
  assert enc.fit(*enc.side([3, 4], list(range(10, 20)), "r", "chosen")) == (
      [4], list(range(10, 15)))
  assert encoder(max_length=6).side([3], [7], "r", "c") == ([3], [7, 1])  # EOS appended


def test_errors_name_the_record():
  enc = encoder()
  with pytest.raises(ValueError, match=r"d\[0\]: the rejected side has no response"):
    dpo_pairs([([3], [4])], [([3], [])], pad_token_id=0, name="d")
  with pytest.raises(ValueError, match=r"d\[0\]: expected an object with \"prompt\", \"chosen\" "
                     r"and \"rejected\" fields, got keys \['chosen', 'rejected'\]; name the "
                     r"record's field with DPOConfig.prompt_field="):
    enc.encode([{"chosen": [4], "rejected": [5]}], name="d", pad_token_id=0)
  with pytest.raises(ValueError, match=r"d\[0\]: \"chosen\" is a chat but \"rejected\" is not"):
    enc.encode([{"prompt": [3], "chosen": [{"role": "assistant", "content": "x"}],
                 "rejected": [5]}], name="d", pad_token_id=0)
  with pytest.raises(ValueError, match="non-empty list"):
    enc.encode([], name="d", pad_token_id=0)


def test_pairs_cut_to_max_length_are_named_and_counted(caplog):
  enc = encoder(max_length=6, add_eos=False)
  records = [{"prompt": [3], "chosen": [4], "rejected": [5]},
             {"prompt": [3, 4, 5, 6, 9], "chosen": [7, 8], "rejected": [7]}]
  with caplog.at_level("WARNING", logger="jax_ppo.data"):
    pairs = enc.encode(records, name="d", pad_token_id=0)
  assert enc.cut_records == {"d": 1}
  assert np.asarray(pairs.chosen_ids)[1].tolist() == [4, 5, 6, 9, 7, 8]
  (warning,) = [r.getMessage() for r in caplog.records]
  assert warning.startswith("1 of 2 preference pairs of d are longer than max_length=6; their "
                            "responses lose their ends first, then their prompts their starts")
  assert warning.endswith("Cut: d[1]")
