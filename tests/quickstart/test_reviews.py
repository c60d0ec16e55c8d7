"""The quickstart's synthetic reviews, gold scorer, preference labels and BPE tokenizer."""

import numpy as np
import pytest

from jax_ppo.quickstart import reviews as R
from jax_ppo.quickstart.tokenizer_training import train_bpe_tokenizer


def test_corpus_is_deterministic_and_mixed():
  a, b = R.make_corpus(300, seed=3), R.make_corpus(300, seed=3)
  assert a == b
  assert a != R.make_corpus(300, seed=4)
  assert all(r.prompt.startswith("Review: The ") and r.response.startswith(" ") for r in a)
  scores = R.gold_scores([r.response for r in a])
  # Mixed sentiment: clearly positive and clearly negative reviews, both common.
  assert np.mean(scores > 0.5) > 0.2 and np.mean(scores < -0.5) > 0.2
  # The gold score follows the latent positivity the reviews were drawn with.
  positivity = np.array([r.positivity for r in a])
  assert np.corrcoef(positivity, scores)[0, 1] > 0.6


@pytest.mark.parametrize(("better", "worse"), [
    (" is sturdy and quiet. I love it.", " is flimsy and noisy. I returned it."),
    (" is sturdy and quiet. I love it.", " great great great great"),
    (" is sturdy and quiet. I love it.", " is great great great great great great."),
    (" is sturdy and quiet. I love it.", " great excellent sturdy reliable quiet lovely"),
    (" feels solid. I would recommend it.", " feels solid. I would not recommend it."),
    (" is lovely and bright. Setup was easy.", " is lovely."),
    (" is lovely and bright. Setup was easy.", " is lovely and bright." * 12),
])
def test_gold_score_ranks(better, worse):
  assert R.gold_score(better) > R.gold_score(worse)


def test_repeating_a_positive_word_never_beats_a_plain_review():
  plain = R.gold_score(" is sturdy and quiet. I love it.")
  for k in range(1, 30):
    assert R.gold_score(" great" * k) < plain
    assert R.gold_score(" The kettle is great." * k) < plain


def test_negation_flips_polarity():
  pos, neg = R.polar_words("I would not recommend it. It never broke.")
  assert pos == {"not_broke"} and neg == {"not_recommend"}


def test_label_pairs_follow_the_gold_score_with_noise():
  corpus = R.make_corpus(400, seed=0)
  a, b = corpus[:200], corpus[200:]
  pairs = R.label_pairs([r.prompt for r in a], [r.response for r in a], [r.response for r in b],
                        temperature=0.2, seed=1)
  assert pairs == R.label_pairs([r.prompt for r in a], [r.response for r in a],
                                [r.response for r in b], temperature=0.2, seed=1)
  margins = np.array([p["gold_margin"] for p in pairs])
  correct = np.mean(margins > 0)
  assert 0.6 < correct < 0.99  # mostly right, but noisy
  # Clear pairs are almost always right.
  assert np.mean(margins[np.abs(margins) > 1.0] > 0) > 0.95
  for p in pairs:
    gold = R.gold_score(p["chosen"]) - R.gold_score(p["rejected"])
    assert p["gold_margin"] == pytest.approx(gold)
  with pytest.raises(ValueError, match="one of each per pair"):
    R.label_pairs(["p"], ["a", "b"], ["c"])


def test_split_and_text_stats():
  items = list(range(50))
  train, held = R.split(items, eval_fraction=0.2, seed=0)
  assert len(held) == 10 and sorted(train + held) == items
  assert R.split(items, eval_fraction=0.2, seed=0) == (train, held)
  assert R.distinct_n(["a b c", "a b d"], 2) == pytest.approx(3 / 4)
  assert R.repetition_rate("great great great great") == pytest.approx(2 / 3)
  stats = R.text_stats([" is sturdy and quiet.", " is flimsy."])
  assert set(stats) == {"gold_score", "distinct_2", "repetition_rate", "length_words"}
  assert stats["length_words"] == 3.0
  with pytest.raises(ValueError, match="eval_fraction"):
    R.split(items, eval_fraction=1.0)


def test_bpe_tokenizer_round_trips_and_has_distinct_specials(tmp_path):
  corpus = R.make_corpus(300, seed=0)
  tok = train_bpe_tokenizer([r.text for r in corpus], vocab_size=400)
  assert len(tok) <= 400
  assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
  assert tok.padding_side == "left"
  for text in [corpus[0].text, "Review: The zeppelin is ünïcode-ish, 42!"]:
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
  # A prompt followed by its response tokenises into (nearly) the same ids as the whole text.
  r = corpus[1]
  assert tok.decode(tok(r.response, add_special_tokens=False)["input_ids"]) == r.response
  tok.save_pretrained(tmp_path)
  from transformers import AutoTokenizer

  again = AutoTokenizer.from_pretrained(tmp_path)
  assert again(corpus[2].text)["input_ids"] == tok(corpus[2].text)["input_ids"]
  assert again.pad_token_id == tok.pad_token_id and again.eos_token_id == tok.eos_token_id
  with pytest.raises(ValueError, match="vocab_size"):
    train_bpe_tokenizer(["a"], vocab_size=100)


def test_corruptions_score_below_a_positive_review():
  rng = np.random.default_rng(0)
  text = " is sturdy and quiet. I love it. Setup was easy."
  for _ in range(20):
    for kind in R.CORRUPTIONS:
      bad = R.corrupt(text, rng, kind)
      assert bad != text
      assert R.gold_score(bad) < R.gold_score(text), (kind, bad)
  assert R.corrupt(text, np.random.default_rng(1)) == R.corrupt(text, np.random.default_rng(1))
  with pytest.raises(ValueError, match="unknown kind 'x'"):
    R.corrupt(text, rng, "x")


def test_split_digits_gives_every_digit_its_own_token(tmp_path):
  texts = ["Q: What is 37 + 48?\nA: 37 + 48 = 85. Answer: 85"] * 50 + ["1234 5678 9900"] * 50
  merged = train_bpe_tokenizer(texts, vocab_size=300)
  split = train_bpe_tokenizer(texts, vocab_size=300, split_digits=True)
  text = "What is 1234 + 85? Answer: 1319"
  tokens = split.convert_ids_to_tokens(split(text, add_special_tokens=False)["input_ids"])
  digits = [t.lstrip("\u0120") for t in tokens if any(c.isdigit() for c in t)]
  assert digits == list("1234" "85" "1319")  # one token per digit, none joined to another
  assert split.decode(split(text)["input_ids"], skip_special_tokens=True) == text
  assert any(sum(c.isdigit() for c in t) > 1
             for t in merged.convert_ids_to_tokens(merged("1234")["input_ids"]))
  split.save_pretrained(tmp_path)
  from transformers import AutoTokenizer

  assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == split(text)["input_ids"]
