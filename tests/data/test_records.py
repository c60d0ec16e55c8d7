"""`jax_ppo.data.records`: the one check every record takes, from a file or a trainer argument.

Degenerate records (empty or whitespace-only texts and messages, roles the templates do not know,
chats that mix the role/content and ShareGPT forms, pairs whose chosen and rejected are the
same, margins out of range) are each one error naming the place, the field and the fix;
ShareGPT chats read as role/content chats; a Parquet row's null fields count as absent, so a
file that mixes text and chat records reads as its JSONL twin does; `warn_cut` names the cut
records and counts them.
"""

import logging
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ppo.data.records import (
    KNOWN_ROLES,
    Record,
    messages,
    preference_record,
    prompt_record,
    sft_record,
    warn_cut,
)

WHERE = "'d.jsonl', line 3"


def rec(data, where=WHERE, raw="{}"):
  return Record(where, data, raw)


def turn(role, content):
  return {"role": role, "content": content}


CHAT = [turn("system", "Be brief."), turn("user", "Hi"), turn("assistant", "Hello")]


def test_sharegpt_chats_read_as_role_content_chats():
  share = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
           {"from": "gpt", "value": "Hello"}]
  assert messages(rec({"conversations": share}), "conversations") == CHAT
  assert sft_record(rec({"messages": share})) == {"messages": CHAT}
  # Extra keys of a message (e.g. "name") stay for the template.
  named = [{"from": "human", "value": "Hi", "name": "ann"}, {"from": "gpt", "value": "Hello"}]
  assert messages(rec({"m": named}), "m")[0] == {"role": "user", "content": "Hi", "name": "ann"}


@pytest.mark.parametrize("chat, message", [
    ([turn("user", "Hi"), turn("bot", "Hello")],
     rf"^{WHERE}: message 1 of \"messages\" has role 'bot'; use one of "
     r"\['system', 'user', 'assistant', 'tool'\] \(ShareGPT's \['gpt', 'human', 'system'\] are "
     r"read as such\)\.$"),
    ([{"from": "human", "value": "Hi"}, {"from": "chatgpt", "value": "Hello"}],
     rf"^{WHERE}: message 1 of \"messages\" has role 'chatgpt' \(ShareGPT's from='chatgpt'\)"),
    ([turn("user", "Hi"), {"from": "gpt", "value": "Hello"}],
     rf"^{WHERE}: \"messages\" mixes role/content and ShareGPT's from/value messages "
     r"\(message 1\); write every message of a chat in one form\.$"),
    ([turn("user", "Hi"), {"from": "gpt", "value": 3}],
     rf"^{WHERE}: message 1 of \"messages\" is .*; a ShareGPT message is "),
    ([turn("user", "Hi"), {"role": "assistant", "text": "Hello"}],
     rf"^{WHERE}: message 1 of \"messages\" is .*; each message is "),
    ([turn("user", "  \n"), turn("assistant", "Hello")],
     rf"^{WHERE}: message 0 of \"messages\" \(user\) is empty or only whitespace; give its text "
     r"or remove the line\.$"),
    ([turn("user", "Hi"), turn("assistant", "")],
     rf"^{WHERE}: message 1 of \"messages\" \(assistant\) is empty or only whitespace"),
    ([], rf"^{WHERE}: \"messages\" is an empty chat; give at least one message or remove the "
         r"line\.$"),
    ([turn("user", "Hi")],
     rf"^{WHERE}: the last message of \"messages\" has role 'user'; it must be the assistant's "
     r"response that SFT trains on\.$"),
], ids=["role", "sharegpt_role", "mixed_forms", "sharegpt_value", "no_content", "empty_user",
        "empty_assistant", "empty_chat", "last_role"])
def test_malformed_chats_are_one_error_naming_the_message(chat, message):
  with pytest.raises(ValueError, match=message):
    sft_record(rec({"messages": chat}))


def test_an_empty_system_message_is_kept():
  chat = [turn("system", ""), turn("user", "Hi"), turn("assistant", "Hello")]
  assert sft_record(rec({"messages": chat})) == {"messages": chat}
  assert set(KNOWN_ROLES) == {"system", "user", "assistant", "tool"}


@settings(max_examples=40, deadline=None)
@given(blank=st.text(alphabet=" \t\n\r\u00a0\u2003", max_size=6),
       field=st.sampled_from(["prompt", "response"]))
def test_whitespace_only_text_is_refused_naming_the_field(blank, field):
  record = {"prompt": "Hi", "response": "Hello", field: blank}
  with pytest.raises(ValueError, match=rf"^{WHERE}: \"{field}\" \(the {field}\) is empty or only "
                                       r"whitespace; give some text or remove the line\.$"):
    sft_record(rec(record))


def test_the_remedy_names_the_line_the_row_or_the_record():
  blank = {"prompt": " ", "response": "Hello"}
  for where, raw, unit in ((WHERE, "{}", "line"), ("'d.parquet', row 4", None, "row"),
                           ("train_data[2]", None, "record")):
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: .* or remove the {unit}\.$"):
      sft_record(Record(where, blank, raw))


def test_null_fields_count_as_absent_so_text_and_chat_rows_mix():
  """A Parquet file of text and chat records has every column in every row (nulls)."""
  text = {"prompt": "Hi", "response": "Hello", "messages": None}
  chat = {"prompt": None, "response": None, "messages": CHAT}
  assert sft_record(rec(text)) == {"prompt": "Hi", "response": "Hello"}
  assert sft_record(rec(chat)) == {"messages": CHAT}
  assert prompt_record(rec({"prompt": None, "messages": CHAT[:2]})) == {"messages": CHAT[:2]}


PAIR = {"prompt": "The film", "chosen": "was good.", "rejected": "was dull."}


@pytest.mark.parametrize("record", [
    {**PAIR, "rejected": "was good."},
    {"prompt": CHAT[:2], "chosen": [turn("assistant", "Yes")],
     "rejected": [turn("assistant", "Yes")]},
    {"chosen": [*CHAT[:2], turn("assistant", "Yes")],
     "rejected": [*CHAT[:2], turn("assistant", "Yes")]},
], ids=["text", "chat", "implicit_prompt"])
def test_identical_pairs_are_refused(record):
  with pytest.raises(ValueError, match=rf"^{WHERE}: \"chosen\" and \"rejected\" are the same "
                                       r"response, so the pair teaches nothing \(its loss gradient "
                                       r"is 0\); give two different responses or remove the "
                                       r"line\.$"):
    preference_record(rec(record))


def test_responses_differing_in_whitespace_alone_are_a_pair():
  """They tokenize apart (two sampled responses often differ so), so the pair has a gradient."""
  assert preference_record(rec({**PAIR, "rejected": "was good. "}))["rejected"] == "was good. "


def test_identical_token_id_pairs_are_refused_where_ids_are_taken():
  record = {"prompt": [3, 4], "chosen": [5, 6], "rejected": [5, 6]}
  with pytest.raises(ValueError, match="are the same response"):
    preference_record(rec(record), token_ids=True)
  with pytest.raises(ValueError, match=r"\"chosen\" must be a string or a chat, got \[5, 6\]"):
    preference_record(rec({**record, "rejected": [7]}))  # files hold text and chats only
  with pytest.raises(ValueError, match=r"\"chosen\" \(the chosen response\) is empty; give at "
                                       r"least one message or token id"):
    preference_record(rec({**record, "chosen": []}), token_ids=True)
  assert preference_record(rec({**record, "rejected": [7]}), token_ids=True)["rejected"] == [7]
  # NumPy vectors of ids are token ids too.
  pair = preference_record(rec({"prompt": np.array([3, 4]), "chosen": np.array([5, 6], np.int32),
                                "rejected": np.array([7])}), token_ids=True)
  assert pair["prompt"] == [3, 4] and pair["chosen"] == [5, 6] and pair["rejected"] == [7]
  with pytest.raises(ValueError, match="are the same response"):
    preference_record(rec({**record, "chosen": np.array([5, 6])}), token_ids=True)


@pytest.mark.parametrize("margin", [-0.5, float("nan"), float("inf"), True, "1", [1.0]])
def test_margins_out_of_range_are_refused(margin):
  with pytest.raises(ValueError, match=rf"^{WHERE}: \"margin\" must be a finite number >= 0, got "
                                       r".*; leave it out for 0\.$"):
    preference_record(rec({**PAIR, "margin": margin}))


def test_margins_in_range_and_absent():
  assert preference_record(rec({**PAIR, "margin": 2}))["margin"] == 2.0
  assert preference_record(rec({**PAIR, "margin": None}))["margin"] == 0.0
  assert preference_record(rec(PAIR))["margin"] == 0.0
  # A stage without margins (DPO) does not read the field.
  assert preference_record(rec({**PAIR, "margin": -1}), margin_field=None)["margin"] == 0.0


def test_missing_fields_name_the_setting_of_the_caller():
  with pytest.raises(ValueError, match=r"got keys \['prompt', 'chosen', 'reject'\]; rename "
                                       r"'reject' to \"rejected\" \(or pass "
                                       r"reward.rejected_field='reject'\)"):
    preference_record(rec({"prompt": "p", "chosen": "a", "reject": "b"}), prefix="reward.")
  with pytest.raises(ValueError, match=r"name the record's field with sft.response_field=\.\.\."):
    sft_record(rec({"prompt": "p", "output": "b"}), prefix="sft.")


def test_warn_cut_names_the_records_and_counts_them(caplog):
  places = [f"'d.jsonl', line {i}" for i in range(1, 8)]
  with caplog.at_level(logging.WARNING, logger="jax_ppo.data"):
    assert warn_cut(places, 10, max_length=16, what="SFT examples", how="cut") == 7
    assert warn_cut([], 10, max_length=16, what="SFT examples", how="cut") == 0
  (message,) = [r.getMessage() for r in caplog.records]
  assert message.startswith("7 of 10 SFT examples are longer than max_length=16; cut (raise "
                            "max_length to keep them whole). Cut: 'd.jsonl', line 1; ")
  assert message.endswith("'d.jsonl', line 5; ...")
