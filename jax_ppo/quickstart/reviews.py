"""A synthetic task for the quickstart: short English product reviews and a gold sentiment scorer.

Everything is generated in code (templates and word lists), so the quickstart downloads nothing:

* `make_corpus(n, seed)`: reviews of mixed sentiment. Each review draws a latent positivity
  `p ~ Uniform(0, 1)` and each of its 2-4 sentences is positive with probability `p`, so the
  corpus holds glowing, mixed and scathing reviews. A review is `"Review: The <product>"` (the
  prompt) followed by its body (the response), e.g.
  `"Review: The kettle" + " is sturdy and quiet. Sadly the lid feels flimsy."`.
* `gold_score(text)`: the task's ground truth, used to label preference pairs and to measure the
  PPO policy (never seen by the policy, which only sees the learned reward model).
* `label_pairs(prompts, a, b, ...)`: Bradley-Terry preference labels from the gold score plus noise.
* `corrupt(text, rng)`: degenerate rewrites (repetition, adjective lists, truncation) for extra
  preference pairs that teach the reward model what the gold score already refuses.
* `distinct_n`, `repetition_rate`: fluency/diversity measures of a set of responses.

The gold score is built so that reward hacking by repetition does not pay (docs/rlhf_details.md
discusses reward hacking): sentiment counts *distinct* polar words with saturating returns
(`1 - 2^-n`), a negator ("not", "never", "no", "hardly") in the two words before a polar word flips
it, and repeated words, repeated bigrams and responses shorter than `MIN_WORDS` or longer than
`MAX_WORDS` words are penalised. "great great great great" scores below a plain positive review.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

PRODUCTS = (
    "blender", "kettle", "toaster", "backpack", "lamp", "keyboard", "mouse", "jacket", "umbrella",
    "headphones", "speaker", "vacuum", "pan", "mug", "charger", "tent", "bike helmet", "desk chair",
    "coffee maker", "phone case", "water bottle", "drill", "printer", "pillow", "watch",
)

POSITIVE_WORDS = (
    "great", "excellent", "sturdy", "reliable", "quiet", "comfortable", "fast", "beautiful",
    "handy", "solid", "perfect", "lovely", "durable", "smooth", "bright", "easy", "love", "loves",
    "recommend", "happy", "impressed", "wonderful", "fantastic", "useful", "worth", "pleased",
)
NEGATIVE_WORDS = (
    "flimsy", "noisy", "broken", "broke", "slow", "cheap", "uncomfortable", "disappointing",
    "disappointed", "useless", "awful", "terrible", "leaks", "leaky", "ugly", "fragile", "hate",
    "waste", "poor", "annoying", "returned", "regret", "unreliable", "dull", "hard", "faulty",
)
NEGATORS = ("not", "never", "no", "hardly", "nothing")

MIN_WORDS = 5
"""Responses with fewer words are penalised linearly (0.25 per missing word)."""
MAX_WORDS = 40
"""Responses with more words are penalised linearly (0.05 per extra word)."""

MAX_POLAR_DENSITY = 0.5
"""Above this fraction of polar words (distinct ones over all words) the score is penalised."""

_POS_ADJ = ("great", "excellent", "sturdy", "reliable", "quiet", "comfortable", "beautiful",
            "handy", "solid", "perfect", "lovely", "durable", "smooth", "bright", "useful")
_NEG_ADJ = ("flimsy", "noisy", "slow", "cheap", "uncomfortable", "disappointing", "useless",
            "awful", "terrible", "ugly", "fragile", "poor", "annoying", "unreliable", "dull",
            "faulty")
_PARTS = ("lid", "handle", "button", "strap", "cable", "switch", "base", "zipper", "cover")
_OPENERS_POS = ("is {a} and {b}.", "feels {a}.", "is {a}, {b} and easy to use.",
                "works well and looks {a}.", "is surprisingly {a}.")
_OPENERS_NEG = ("is {a} and {b}.", "feels {a}.", "is {a} and hard to use.",
                "arrived broken and looks {a}.", "is really {a}.")
_MORE_POS = ("The {part} feels {a}.", "I use it every day.", "I love it.",
             "I would recommend it to a friend.", "Setup was easy.", "It is worth the price.",
             "My family loves it.", "Very happy with it.", "The {part} is {a} and {b}.",
             "It has been {a} for months.", "Shipping was fast.", "I am impressed.")
_MORE_NEG = ("The {part} feels {a}.", "It broke after a week.", "I returned it.",
             "I would not recommend it.", "Setup was hard.", "It is a waste of money.",
             "The {part} is {a} and {b}.", "It leaks.", "I regret buying it.",
             "Shipping was slow.", "I am disappointed.", "Customer service was poor.")

_WORD_RE = re.compile(r"[a-z']+")
_POLARITY = {**{w: 1 for w in POSITIVE_WORDS}, **{w: -1 for w in NEGATIVE_WORDS}}


@dataclasses.dataclass(frozen=True)
class Review:
  """One synthetic review: `prompt + response` is the full text."""

  prompt: str  # "Review: The <product>"
  response: str  # " is sturdy and quiet. I love it."
  positivity: float  # The latent probability that a sentence is positive.

  @property
  def text(self) -> str:
    return self.prompt + self.response


def prompt_for(product: str) -> str:
  """The review opening the policy continues: `"Review: The <product>"`."""
  return f"Review: The {product}"


def _sentence(rng: np.random.Generator, templates: Sequence[str], adjectives: Sequence[str]) -> str:
  template = templates[int(rng.integers(len(templates)))]
  a, b = rng.choice(len(adjectives), size=2, replace=False)
  part = _PARTS[int(rng.integers(len(_PARTS)))]
  return template.format(a=adjectives[a], b=adjectives[b], part=part)


def make_review(rng: np.random.Generator, product: str | None = None) -> Review:
  """One review: a positivity `p ~ U(0, 1)`, an opening clause and 1-3 more sentences, each
  positive with probability `p`."""
  if product is None:
    product = PRODUCTS[int(rng.integers(len(PRODUCTS)))]
  p = float(rng.uniform())
  positive = rng.uniform() < p
  parts = [_sentence(rng, _OPENERS_POS, _POS_ADJ) if positive
           else _sentence(rng, _OPENERS_NEG, _NEG_ADJ)]
  for _ in range(int(rng.integers(1, 4))):
    if rng.uniform() < p:
      parts.append(_sentence(rng, _MORE_POS, _POS_ADJ))
    else:
      parts.append(_sentence(rng, _MORE_NEG, _NEG_ADJ))
  return Review(prompt=prompt_for(product), response=" " + " ".join(parts), positivity=p)


def make_corpus(n: int, *, seed: int = 0) -> list[Review]:
  """`n` reviews, the same for the same `(n, seed)`."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"make_corpus: n must be an int >= 1, got {n!r}.")
  rng = np.random.default_rng(seed)
  return [make_review(rng) for _ in range(n)]


def split(items: Sequence, *, eval_fraction: float, seed: int = 0) -> tuple[list, list]:
  """`(train, held_out)`: a seeded shuffle, the last `round(eval_fraction * n)` items held out
  (at least one of each when `0 < eval_fraction < 1` and `n >= 2`)."""
  if not 0 <= eval_fraction < 1:
    raise ValueError(f"split: eval_fraction must be in [0, 1), got {eval_fraction}.")
  order = np.random.default_rng(seed).permutation(len(items))
  n_eval = round(eval_fraction * len(items))
  if eval_fraction > 0 and len(items) >= 2:
    n_eval = min(max(n_eval, 1), len(items) - 1)
  cut = len(items) - n_eval
  return [items[i] for i in order[:cut]], [items[i] for i in order[cut:]]


def words(text: str) -> list[str]:
  """Lower-case words (letters and apostrophes) of `text`."""
  return _WORD_RE.findall(text.lower())


def polar_words(text: str) -> tuple[set[str], set[str]]:
  """`(positive, negative)` distinct polar words of `text`; a negator among the two words before
  a polar word flips it (it is recorded as `"not_<word>"` on the other side)."""
  ws = words(text)
  pos: set[str] = set()
  neg: set[str] = set()
  for i, w in enumerate(ws):
    polarity = _POLARITY.get(w)
    if polarity is None:
      continue
    if any(v in NEGATORS for v in ws[max(0, i - 2):i]):
      polarity, w = -polarity, "not_" + w
    (pos if polarity > 0 else neg).add(w)
  return pos, neg


def repetition_rate(text: str) -> float:
  """Fraction of the word bigrams of `text` that repeat an earlier bigram (0 for < 2 words)."""
  ws = words(text)
  bigrams = list(zip(ws, ws[1:], strict=False))
  if not bigrams:
    return 0.0
  return 1.0 - len(set(bigrams)) / len(bigrams)


def gold_score(text: str) -> float:
  r"""The task's ground-truth score of a response (higher = more positive and well formed).

  .. math::
      g = (1 - 2^{-n_+}) - (1 - 2^{-n_-})
          - 2\,\max(0, r_w - 0.4) - 2\,r_b - 2\,\max(0, d - 0.5) - \text{length penalty}

  with `n_+`, `n_-` the numbers of *distinct* positive and negative words (`polar_words`),
  `r_w = 1 - distinct words / words`, `r_b = repetition_rate(text)` and `d` the fraction of
  words that are distinct polar words (a bare list of adjectives is not a review). The length
  penalty is `0.25` per word below `MIN_WORDS` and `0.05` per word above `MAX_WORDS`. The
  sentiment term lies in (-1, 1); a response repeating one positive word gains at most 0.5 and
  loses more.
  """
  ws = words(text)
  n = len(ws)
  pos, neg = polar_words(text)
  score = (1.0 - 0.5 ** len(pos)) - (1.0 - 0.5 ** len(neg))
  if n:
    score -= 2.0 * max(0.0, 1.0 - len(set(ws)) / n - 0.4)
  score -= 2.0 * repetition_rate(text)
  score -= 0.25 * max(0, MIN_WORDS - n) + 0.05 * max(0, n - MAX_WORDS)
  if n:
    score -= 2.0 * max(0.0, (len(pos) + len(neg)) / n - MAX_POLAR_DENSITY)
  return float(score)


def gold_scores(texts: Sequence[str]) -> np.ndarray:
  """`gold_score` of every text, `[N]` float64."""
  return np.asarray([gold_score(t) for t in texts], np.float64)


def label_pairs(
    prompts: Sequence[str],
    responses_a: Sequence[str],
    responses_b: Sequence[str],
    *,
    temperature: float = 0.1,
    seed: int = 0,
) -> list[dict[str, str | float]]:
  r"""Preference triples `{prompt, chosen, rejected, gold_margin}` labelled by a noisy annotator.

  The annotator prefers `a` with the Bradley-Terry probability
  :math:`\sigma((g_a - g_b) / \tau)` (`g` the gold score, `tau` = `temperature`): close pairs are
  often mislabelled, clear ones rarely. Pairs with identical responses are dropped.
  `gold_margin` is `g_chosen - g_rejected` (negative when the label is wrong).
  """
  if not len(prompts) == len(responses_a) == len(responses_b):
    raise ValueError(
        f"label_pairs: got {len(prompts)} prompts, {len(responses_a)} responses_a and "
        f"{len(responses_b)} responses_b; pass one of each per pair."
    )
  if not temperature > 0:
    raise ValueError(f"label_pairs: temperature must be > 0, got {temperature}.")
  rng = np.random.default_rng(seed)
  out = []
  for p, a, b in zip(prompts, responses_a, responses_b, strict=True):
    u = rng.uniform()
    if a == b:
      continue
    ga, gb = gold_score(a), gold_score(b)
    prob_a = 1.0 / (1.0 + np.exp(-(ga - gb) / temperature))
    chosen, rejected = (a, b) if u < prob_a else (b, a)
    margin = (ga - gb) if chosen == a else (gb - ga)
    out.append({"prompt": p, "chosen": chosen, "rejected": rejected, "gold_margin": float(margin)})
  return out


CORRUPTIONS = ("repeat_word", "repeat_sentence", "adjective_list", "truncate")
"""Degenerate rewrites of a response that a reward model should learn to dislike."""


def corrupt(text: str, rng: np.random.Generator, kind: str | None = None) -> str:
  """A degenerate version of `text` (the reward hacks a policy may find):

  * "repeat_word": one positive word repeated 3-8 times (" great great great");
  * "repeat_sentence": the first sentence of `text` repeated 2-4 times;
  * "adjective_list": 4-8 distinct positive adjectives in a row;
  * "truncate": the first 1-3 words of `text`.

  `kind` None picks one uniformly. Used to add (response, corrupted response) preference pairs,
  labelled by `gold_score` like the others, so the reward model sees such responses.
  """
  if kind is None:
    kind = CORRUPTIONS[int(rng.integers(len(CORRUPTIONS)))]
  if kind == "repeat_word":
    word = _POS_ADJ[int(rng.integers(len(_POS_ADJ)))]
    return " " + " ".join([word] * int(rng.integers(3, 9)))
  if kind == "repeat_sentence":
    first = text.strip().split(".")[0].strip() or "great"
    return " " + " ".join([first + "."] * int(rng.integers(2, 5)))
  if kind == "adjective_list":
    k = int(rng.integers(4, 9))
    return " is " + " ".join(_POS_ADJ[i] for i in rng.choice(len(_POS_ADJ), k, replace=False))
  if kind == "truncate":
    return " " + " ".join(text.split()[:int(rng.integers(1, 4))])
  raise ValueError(f"corrupt: unknown kind {kind!r}; choose one of {CORRUPTIONS}.")


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
  """Distinct-n (Li et al. 2016): distinct word n-grams over all n-grams of all `texts`
  (0 when there is none)."""
  if n < 1:
    raise ValueError(f"distinct_n: n must be >= 1, got {n}.")
  grams: list[tuple[str, ...]] = []
  for t in texts:
    ws = words(t)
    grams.extend(tuple(ws[i:i + n]) for i in range(len(ws) - n + 1))
  return len(set(grams)) / len(grams) if grams else 0.0


def text_stats(responses: Sequence[str]) -> dict[str, float]:
  """Gold score, distinct-2, repetition rate and length (words) of a set of responses."""
  if len(responses) == 0:
    raise ValueError("text_stats: `responses` is empty.")
  return {
      "gold_score": float(gold_scores(responses).mean()),
      "distinct_2": distinct_n(responses, 2),
      "repetition_rate": float(np.mean([repetition_rate(r) for r in responses])),
      "length_words": float(np.mean([len(words(r)) for r in responses])),
  }
