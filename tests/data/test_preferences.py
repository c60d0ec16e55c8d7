"""The forms of a preference record (jax_ppo.data.preferences): the implicit prompt of two whole
conversations is their shared turns, explicit and text records pass unchanged, bad forms raise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.data.preferences import explicit_preference, is_chat

_text = st.text(min_size=1, max_size=8)
_turn = st.builds(lambda role, text: {"role": role, "content": text},
                  st.sampled_from(["system", "user", "assistant"]), _text)
_answer = st.builds(lambda text: {"role": "assistant", "content": text}, _text)


@given(st.lists(_turn, min_size=1, max_size=5), _answer, _answer)
def test_implicit_prompt_is_the_shared_turns(shared, good, bad):
  chosen, rejected = [*shared, good], [*shared, bad]
  out = explicit_preference(None, chosen, rejected, where="r")
  assert out == (shared, [good], [bad])
  # A prompt string beside whole conversations (UltraFeedback) is not used.
  assert explicit_preference("anything", chosen, rejected, where="r") == out
  # The explicit form is a fixed point, and the inputs are not modified.
  assert explicit_preference(*out, where="r") == out
  assert chosen == [*shared, good] and rejected == [*shared, bad]


@given(st.one_of(_text, st.lists(st.integers(0, 9), min_size=1)),
       st.one_of(_text, st.lists(st.integers(0, 9), min_size=1)))
def test_text_and_id_records_pass_unchanged(chosen, rejected):
  prompt = [{"role": "user", "content": "hi"}]
  assert explicit_preference(prompt, chosen, rejected, where="r") == (prompt, chosen, rejected)
  assert explicit_preference("hi", chosen, rejected, where="r") == ("hi", chosen, rejected)
  with pytest.raises(ValueError, match=r"^r: no \"q\"; a record with text responses needs"):
    explicit_preference(None, chosen, rejected, where="r", fields=("q", "c", "x"))


def test_is_chat_and_field_names_in_errors():
  assert is_chat([{"role": "user", "content": "a"}])
  assert not any(map(is_chat, ["ab", [], [1, 2], None, [{"role": "user"}, "b"]]))
  user, answer = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
  with pytest.raises(ValueError, match=r"^rec 3: \"good\" is a chat but \"bad\" is not"):
    explicit_preference([user], [answer], "b", where="rec 3", fields=("ctx", "good", "bad"))
  with pytest.raises(ValueError, match=r"last message of \"bad\" has role 'user'"):
    explicit_preference([user], [answer], [answer, user], where="r",
                        fields=("ctx", "good", "bad"))
  with pytest.raises(ValueError, match=r"without a \"ctx\" chat, .* differ before their last "
                                       r"turns; give the turns before the responses as \"ctx\""):
    explicit_preference(None, [user, answer], [answer, answer], where="r",
                        fields=("ctx", "good", "bad"))
