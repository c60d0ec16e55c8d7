"""Pairwise reward-model training: the Bradley-Terry loss and accuracy against NumPy, the margin,
padding, learning a toy preference, reward normalisation through export, resume, bad inputs."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo import models
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.hf import SCORE_BIAS_KEY
from jax_ppo.reward_model import (
    NORMALISATION_FILE,
    RewardModelConfig,
    RewardModelOptimizer,
    RewardModelTrainer,
    bradley_terry_loss,
    normalisation_from_scores,
    preference_pairs,
)
from jax_ppo.reward_model.pairwise import pair_scores
from jax_ppo.training import RunOptions

MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)
TARGET, EOS = 7, 2


def np_reference(rc, rr, margin, weight):
  d = np.asarray(rc, np.float64) - np.asarray(rr, np.float64) - np.asarray(margin, np.float64)
  w = np.asarray(weight, np.float64)
  loss = np.sum(w * np.logaddexp(0.0, -d)) / np.sum(w)  # -log sigmoid(d), stably
  accuracy = np.sum(w * (np.asarray(rc) > np.asarray(rr))) / np.sum(w)
  return loss, accuracy


_scores = st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=8)


@given(_scores, _scores, _scores, st.lists(st.floats(0, 2, width=32), min_size=8, max_size=8))
def test_loss_and_accuracy_match_numpy(rc, rr, margin, weight):
  n = min(len(rc), len(rr), len(margin))
  rc, rr, margin = (np.asarray(x[:n], np.float32) for x in (rc, rr, margin))
  weight = np.asarray(weight[:n], np.float32)
  weight[0] = max(weight[0], 0.5)  # at least one pair counts
  loss, metrics = jax.jit(bradley_terry_loss)(rc, rr, margin=margin, weight=weight)
  ref_loss, ref_acc = np_reference(rc, rr, margin, weight)
  assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(metrics["accuracy"]), ref_acc, atol=1e-6)
  np.testing.assert_allclose(float(metrics["margin"]), np.sum(weight * (rc - rr)) / weight.sum(),
                             rtol=1e-5, atol=1e-4)


def test_margin_shifts_the_loss_as_the_formula_says():
  rc = jnp.array([1.0, 0.5, -2.0, 3.0])
  rr = jnp.array([0.0, 1.0, -2.5, -1.0])
  margin = jnp.array([0.0, 0.5, 1.0, 2.0])
  with_margin, m1 = bradley_terry_loss(rc, rr, margin=margin)
  shifted, _ = bradley_terry_loss(rc - margin, rr)  # m enters exactly like a lower r_chosen
  np.testing.assert_allclose(float(with_margin), float(shifted), rtol=1e-6)
  np.testing.assert_allclose(float(with_margin), np_reference(rc, rr, margin, np.ones(4))[0],
                             rtol=1e-6)
  plain, m0 = bradley_terry_loss(rc, rr)
  assert float(with_margin) > float(plain)  # a margin asks for a wider separation
  assert float(m1["accuracy"]) == float(m0["accuracy"]) == 0.75  # not part of the accuracy
  # Per pair: d/dm of -log sigmoid(d - m) is sigmoid(m - d) (> 0, and 1/2 at m = d).
  grad = jax.grad(lambda m: bradley_terry_loss(rc[:1], rr[:1], margin=m)[0])(jnp.array([1.0]))
  np.testing.assert_allclose(float(grad[0]), 0.5, rtol=1e-6)


def _pad(seq, length, side):
  ids = np.zeros(length, np.int32)
  mask = np.zeros(length, np.int32)
  sl = slice(0, len(seq)) if side == "right" else slice(length - len(seq), length)
  ids[sl], mask[sl] = seq, 1
  return ids, mask


def test_scores_are_read_at_the_last_valid_token_with_left_and_right_padding():
  model = ScalarModel(MODEL, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  seqs = [list(rng.integers(3, 24, size=n)) for n in (4, 6, 6, 4)]  # two shapes: two compiles
  chosen, rejected = seqs[:2], seqs[2:]

  @jax.jit
  def score(state, ids, mask):
    return nnx.merge(graphdef, state).score(ids, mask)

  # Reference: each sequence alone, unpadded; its score is the output at its own last token.
  ref = [float(score(state, np.array([s]), np.ones((1, len(s)), np.int32))[0]) for s in seqs]

  def pairs(side_c, side_r, junk=0):
    rows = [_pad(s, 9, side) for s, side in zip(chosen + rejected,
                                                 (side_c, side_c, side_r, side_r), strict=True)]
    ids = np.stack([r[0] for r in rows])
    mask = np.stack([r[1] for r in rows])
    ids = np.where(mask == 1, ids, junk)  # whatever the pad slots hold
    return preference_pairs(ids[:2], mask[:2], ids[2:], mask[2:], margin=[0.3, -0.2])

  fn = jax.jit(lambda s, p: pair_scores(nnx.merge(graphdef, s), p))
  for sides, junk in (("right", "right"), 0), (("left", "left"), 0), (("left", "right"), 11):
    c, r = fn(state, pairs(*sides, junk=junk))
    np.testing.assert_allclose(np.concatenate([c, r]), ref, atol=2e-5, err_msg=str(sides))
    loss, metrics = bradley_terry_loss(c, r, margin=jnp.array([0.3, -0.2]))
    ref_loss, ref_acc = np_reference(ref[:2], ref[2:], [0.3, -0.2], [1, 1])
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert float(metrics["accuracy"]) == ref_acc


def _toy_records(n, seed):
  """Chosen responses contain TARGET, rejected ones do not."""
  rng = np.random.default_rng(seed)
  others = [t for t in range(3, MODEL.vocab_size) if t != TARGET]
  out = []
  for _ in range(n):
    prompt = [int(t) for t in rng.choice(others, size=int(rng.integers(2, 5)))]
    chosen = [int(t) for t in rng.choice(others, size=int(rng.integers(2, 6)))]
    chosen[int(rng.integers(len(chosen)))] = TARGET
    rejected = [int(t) for t in rng.choice(others, size=int(rng.integers(2, 6)))]
    out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
  return out


def test_learns_a_toy_preference_to_high_held_out_accuracy():
  config = RewardModelConfig(batch_size=32, total_steps=25, eos_token_id=EOS, max_length=16,
                             eval_every=25, optimizer=RewardModelOptimizer(
                                 learning_rate=3e-3, lr_schedule="constant"))
  trainer = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                               train_data=_toy_records(256, 0), eval_data=_toy_records(128, 1))
  before = trainer.evaluate()
  history = trainer.train()
  after = trainer.evaluate()
  assert len(history) == 25 and trainer.step_count == 25
  assert before["eval/accuracy"] < 0.75 and after["eval/accuracy"] > 0.9, (before, after)
  assert after["eval/loss"] < before["eval/loss"] and after["eval/pairs"] == 128
  assert history[-1]["eval/accuracy"] == after["eval/accuracy"]  # the eval_every evaluation
  assert all(m["skipped_updates"] == 0 for m in history)
  assert history[-1]["train/loss"] < history[0]["train/loss"]

  # A non-finite loss leaves the parameters unchanged and is reported as skipped.
  pairs = trainer.train_pairs.take(trainer.batch_index(0))
  pairs = pairs.replace(margin=np.full_like(pairs.margin, np.nan))
  state = jax.tree.map(jnp.copy, trainer.state)
  new, metrics = trainer.steps.train_step(state, trainer.rest, pairs)
  assert float(metrics["skipped_updates"]) == 1 and int(new.step) == 26
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               new.params, trainer.state.params)


def test_normalisation_from_scores():
  s = np.array([2.0, 4.0, 9.0, -1.0])
  n = normalisation_from_scores(s)
  z = n["gain"] * s + n["bias"]
  np.testing.assert_allclose([z.mean(), z.std()], [0.0, 1.0], atol=1e-12)
  assert n["mean"] == 3.5 and n["samples"] == 4
  for bad, match in (([1.0], ">= 2"), ([1.0, np.nan], "NaN"), ([3.0, 3.0, 3.0], "std")):
    with pytest.raises(ValueError, match=match):
      normalisation_from_scores(np.array(bad))


def _word_tokenizer(path):
  import transformers
  from tokenizers import Tokenizer, pre_tokenizers
  from tokenizers import models as tok_models

  words = ["<pad>", "<s>", "</s>", "<unk>", "the", "film", "was", "good", "bad", "great",
           "dull", "plot", "very", "not", "user", "assistant", ":"]
  backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="</s>", bos_token="<s>", unk_token="<unk>",
      pad_token="<pad>")
  tok.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                       "{% if add_generation_prompt %}assistant :{% endif %}")
  tok.save_pretrained(str(path))
  return transformers.AutoTokenizer.from_pretrained(str(path))


def test_encodes_text_chat_and_id_records_with_eos_padding_and_margins(tmp_path):
  pytest.importorskip("tokenizers")
  tok = _word_tokenizer(tmp_path / "tok")
  config = RewardModelConfig(batch_size=2, total_steps=1, max_length=8)
  trainer = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)), tokenizer=tok,
                               train_data=[
      {"prompt": "the film was", "chosen": "very good", "rejected": "bad", "margin": 1.5},
      {"prompt": [{"role": "user", "content": "the film"}], "chosen": "good",
       "rejected": [8, 2]},
      {"prompt": [4, 5, 6, 4, 5, 6, 4], "chosen": [9, 9], "rejected": [10]},
  ])
  p = trainer.train_pairs
  chat = [14, 16, 4, 5, 15, 16]  # "user : the film assistant :"
  assert p.chosen_ids.tolist() == [[4, 5, 6, 12, 7, 2, 0, 0], chat + [7, 2],
                                   [6, 4, 5, 6, 4, 9, 9, 2]]  # the start is cut to max_length
  assert p.rejected_ids.tolist() == [[4, 5, 6, 8, 2, 0, 0, 0], chat + [8, 2],
                                     [5, 6, 4, 5, 6, 4, 10, 2]]  # an EOS is never doubled
  assert p.chosen_mask.sum(1).tolist() == [6, 8, 8] and p.rejected_mask.sum(1).tolist() == [5, 8, 8]
  np.testing.assert_array_equal(p.margin, [1.5, 0.0, 0.0])


def test_conversational_records_score_the_template_up_to_eos(tmp_path):
  """Chat responses (with a prompt chat, or whole conversations without one) are the chat
  template of the conversation, split as SFT splits it and ending at EOS, as a sampled response
  does: the template's text after the assistant's EOS is not scored."""
  pytest.importorskip("tokenizers")
  from jax_ppo.data.sft import encode_record

  tok = _word_tokenizer(tmp_path / "tok")
  tok.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}"
                       "{% if m['role'] == 'assistant' %} </s> the{% endif %} {% endfor %}"
                       "{% if add_generation_prompt %}assistant :{% endif %}")
  user = [{"role": "user", "content": "the film"}]
  good = [{"role": "assistant", "content": "was good"}]
  bad = [{"role": "assistant", "content": "was bad"}]
  forms = [{"prompt": user, "chosen": good, "rejected": bad},
           {"chosen": user + good, "rejected": user + bad},
           {"prompt": "the film", "chosen": user + good, "rejected": user + bad}]
  config = RewardModelConfig(batch_size=3, total_steps=1, max_length=16)
  trainer = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)), tokenizer=tok,
                               train_data=forms)
  p = trainer.train_pairs
  head = [14, 16, 4, 5, 15, 16]  # "user : the film assistant :"
  assert p.chosen_ids.tolist() == [head + [6, 7, 2]] * 3  # "was good </s>", not "the" after it
  assert p.rejected_ids.tolist() == [head + [6, 8, 2]] * 3
  sft = encode_record({"messages": user + good}, tok)
  assert list(sft.prompt_ids + sft.response_ids) == head + [6, 7, 2, 4]  # SFT's own split
  with pytest.raises(ValueError, match=r"train_data\[1\]: without a \"prompt\" chat, \"chosen\" "
                                       r"and \"rejected\" .* differ before their last turns"):
    RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)), tokenizer=tok,
                       train_data=[forms[0], {"chosen": user + good, "rejected": bad}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.chosen holds text but no tokenizer"):
    RewardModelTrainer(dataclasses.replace(config, eos_token_id=EOS),
                       ScalarModel(MODEL, rngs=nnx.Rngs(0)), train_data=forms[:1])


def test_eval_fraction_holds_out_disjoint_pairs():
  records = _toy_records(20, 4)
  config = RewardModelConfig(batch_size=4, total_steps=1, eos_token_id=EOS, eval_fraction=0.25)
  trainer = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)), train_data=records)
  rows = lambda ids: {tuple(r) for r in np.asarray(ids).tolist()}  # noqa: E731
  held, kept = rows(trainer.eval_pairs.chosen_ids), rows(trainer.train_pairs.chosen_ids)
  assert len(held) == 5 and len(kept) == 15 and not held & kept
  with pytest.raises(ValueError, match="eval_fraction=0.99 holds out all 3 pairs"):
    RewardModelTrainer(dataclasses.replace(config, eval_fraction=0.99),
                       ScalarModel(MODEL, rngs=nnx.Rngs(0)), train_data=records[:3])


@pytest.mark.slow
def test_normalise_then_export_is_read_alike_by_load_scalar_model_and_transformers(tmp_path):
  torch = pytest.importorskip("torch", reason="transformers' reference model needs PyTorch")
  pytest.importorskip("tokenizers")
  import transformers

  from tests.models.conftest import hf_config

  tok = _word_tokenizer(tmp_path / "tok")
  config = models.config.config_from_hf(hf_config("qwen2", pad_token_id=0))
  records = [{"prompt": "the film was", "chosen": c, "rejected": r}
             for c, r in (("good", "bad"), ("very good", "dull"), ("great", "not good"),
                          ("good plot", "bad plot"))]
  trainer = RewardModelTrainer(
      RewardModelConfig(batch_size=2, total_steps=2, max_length=12,
                        optimizer=RewardModelOptimizer(learning_rate=1e-3)),
      ScalarModel(config, rngs=nnx.Rngs(3)), train_data=records, eval_data=records,
      tokenizer=tok)
  assert trainer.train_pairs.chosen_ids[0, :5].tolist() == [4, 5, 6, 7, 2]  # text + EOS
  trainer.train()

  # "SFT samples": mixed left and right padding, pad id 0 only in pad slots.
  rng = np.random.default_rng(0)
  rows = [_pad(list(rng.integers(3, 160, size=n)), 10, side)
          for n, side in zip((3, 10, 6, 8, 5, 9, 4, 7), "lrlrlrlr", strict=True)]
  ids = np.stack([r[0] for r in rows])
  mask = np.stack([r[1] for r in rows])
  raw = trainer.score(ids, mask)
  before = trainer.evaluate()
  norm = trainer.normalise(input_ids=ids, attention_mask=mask)
  scores = trainer.score(ids, mask)
  np.testing.assert_allclose([scores.mean(), scores.std()], [0.0, 1.0], atol=2e-5)
  np.testing.assert_allclose(scores, norm["gain"] * raw + norm["bias"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(norm["mean"], raw.mean(), rtol=1e-5, atol=1e-6)
  # A positive gain keeps every preference: the same accuracy, a different loss.
  assert trainer.evaluate()["eval/accuracy"] == before["eval/accuracy"]
  assert trainer.evaluate()["eval/loss"] != pytest.approx(before["eval/loss"])

  path = trainer.export(tmp_path / "rm")
  assert json.loads((path / NORMALISATION_FILE).read_text())["gain"] == norm["gain"]
  loaded = models.load_scalar_model(str(path))
  graphdef, state = nnx.split(loaded)
  ours = np.asarray(jax.jit(lambda s, i, m: nnx.merge(graphdef, s).score(i, m))(state, ids, mask))
  np.testing.assert_allclose(ours, scores, atol=2e-5)
  bias = json.loads((path / "config.json").read_text())[SCORE_BIAS_KEY]
  np.testing.assert_allclose(bias, norm["bias"], rtol=1e-5, atol=1e-6)

  hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    logits = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(pos)).logits.numpy()[:, 0]
  np.testing.assert_allclose(logits + bias, scores, atol=2e-4)  # transformers leaves out bias
  np.testing.assert_allclose(logits.std(), 1.0, atol=1e-4)  # the gain is in score.weight
  assert transformers.AutoTokenizer.from_pretrained(str(path)).get_vocab() == tok.get_vocab()


def _run_trainer(run_dir=None, *, save_every: int):
  """A 4-step reward-model run on toy pairs, optionally in `run_dir` (synchronous saves)."""
  config = RewardModelConfig(batch_size=16, total_steps=4, max_length=16, eos_token_id=EOS,
                             optimizer=RewardModelOptimizer(learning_rate=3e-3))
  options = RunOptions(save_every=save_every, progress=False, tensorboard=False,
                       async_checkpointing=False)
  return RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                            train_data=_toy_records(40, 2), run_dir=run_dir,
                            run_options=options)


@pytest.mark.slow
def test_run_folder_logs_checkpoints_and_resumes_like_an_uninterrupted_run(tmp_path):
  def make(run_dir=None):
    return _run_trainer(run_dir, save_every=2)

  straight = make()
  straight.train()
  with make(tmp_path / "run") as first:
    first.train(2)
  with make(tmp_path / "run") as resumed:
    assert resumed.step_count == 2
    resumed.train()
    assert resumed.step_count == 4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 resumed.state.params, straight.state.params)
    norm = resumed.normalise(scores=[1.0, 2.0, 4.0])
    record = json.loads((tmp_path / "run" / NORMALISATION_FILE).read_text())
    assert record == norm and record["samples"] == 3
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3, 4]
  assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.parametrize("field, value", [
    ("batch_size", 0), ("max_length", 1), ("total_steps", 0), ("eval_every", -1),
    ("pad_token_id", -2), ("chosen_field", ""), ("add_eos", "yes"), ("eos_token_id", 1.5),
    ("eval_fraction", 1.0), ("max_consecutive_skips", 0), ("gradient_accumulation_steps", 0),
])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"RewardModelConfig\.{field}=.*invalid: "):
    RewardModelConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("learning_rate", 0.0), ("lr_schedule", "step"), ("adam_b2", 1.0), ("max_grad_norm", -1.0),
    ("weight_decay", -0.1), ("adam_b1", "0.9"), ("learning_rate", float("nan")),
])
def test_optimizer_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"RewardModelOptimizer\.{field}=.*invalid: "):
    RewardModelOptimizer(**{field: value})


def test_optimizer_block_keeps_the_reward_model_defaults():
  """A block that sets one field keeps the reward model's other defaults."""
  block = RewardModelOptimizer(warmup_steps=3)
  assert (block.learning_rate, block.lr_schedule, block.adam_eps) == (1e-5, "linear", 1e-8)
  assert RewardModelConfig().optimizer == RewardModelOptimizer()
  with pytest.raises(ValueError, match=r"learning_rate=0.0 is invalid: .*reward-model"):
    RewardModelOptimizer(learning_rate=0.0)


def test_accumulation_must_divide_the_batch():
  with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 is invalid: it must "
                                       r"divide batch_size \(8\)"):
    RewardModelConfig(batch_size=8, gradient_accumulation_steps=3)


def test_warmup_longer_than_the_run_is_refused():
  with pytest.raises(ValueError, match=r"optimizer=.* is invalid: its warmup_steps \(5\) "
                                       r"exceeds .*total_steps \(3\)"):
    RewardModelConfig(total_steps=3, optimizer=RewardModelOptimizer(warmup_steps=5))
  with pytest.raises(ValueError, match=r"optimizer\.warmup_steps=5 is invalid: .*1 optimizer "
                                       r"steps"):
    RewardModelTrainer(RewardModelConfig(batch_size=4, add_eos=False,
                                         optimizer=RewardModelOptimizer(warmup_steps=5)),
                       ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                       train_data=[{"prompt": [3], "chosen": [4], "rejected": [5]}])


def test_bad_data_errors_name_the_record_and_field():
  model = ScalarModel(MODEL, rngs=nnx.Rngs(0))
  config = RewardModelConfig(batch_size=2, total_steps=1, eos_token_id=EOS)

  def trainer(data, **kw):
    return RewardModelTrainer(config, model, train_data=data, **kw)

  good = {"prompt": [3, 4], "chosen": [5], "rejected": [6]}
  with pytest.raises(ValueError, match=r"train_data\[1\] lacks field\(s\) \['rejected'\]"):
    trainer([good, {"prompt": [3], "chosen": [5], "reject": [6]}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.chosen holds text but no tokenizer"):
    trainer([{"prompt": [3], "chosen": "good", "rejected": [6]}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.rejected .*\[0, 24\)"):
    trainer([{"prompt": [3], "chosen": [5], "rejected": [99]}])
  with pytest.raises(ValueError, match=r"eval_data\[0\]\.margin='big'"):
    trainer([good], eval_data=[{**good, "margin": "big"}])
  with pytest.raises(ValueError, match="non-empty list of records"):
    trainer([])
  ones = lambda *shape: np.ones(shape, np.int32)  # noqa: E731
  with pytest.raises(ValueError, match="rejected row 1 has no valid token"):
    preference_pairs(ones(2, 3), ones(2, 3), ones(2, 3), np.array([[1, 1, 0], [0, 0, 0]]))
  with pytest.raises(ValueError, match=r"rejected_ids has shape \(2, 4\)"):
    preference_pairs(ones(2, 3), ones(2, 3), ones(2, 4), ones(2, 4))
  with pytest.raises(ValueError, match="chosen_ids must hold integers"):
    preference_pairs(np.ones((2, 3)), ones(2, 3), ones(2, 3), ones(2, 3))
  with pytest.raises(ValueError, match=r"margin must be 2 finite numbers"):
    preference_pairs(ones(2, 3), ones(2, 3), ones(2, 3), ones(2, 3), margin=[0.0, np.inf])
  with pytest.raises(ValueError, match="add_eos is True but there is no EOS id"):
    RewardModelTrainer(RewardModelConfig(total_steps=1), model, train_data=[good])
  with pytest.raises(TypeError, match="ScalarModel"):
    RewardModelTrainer(config, object(), train_data=[good])
  t = trainer([good])
  with pytest.raises(ValueError, match="No held-out split"):
    t.evaluate()
  with pytest.raises(ValueError, match="either scores or input_ids"):
    t.normalise()


@pytest.mark.slow
def test_lora_trains_only_the_adapters_and_the_head():
  from jax_ppo.models.lora import LoRAConfig, add_lora

  def flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}

  model = add_lora(ScalarModel(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=2), rngs=nnx.Rngs(1))
  config = RewardModelConfig(batch_size=16, total_steps=3, max_length=16, add_eos=False,
                             optimizer=RewardModelOptimizer(learning_rate=1e-2))
  trainer = RewardModelTrainer(config, model, train_data=_toy_records(32, 3))
  start, rest = flat(trainer.state.params), flat(trainer.rest)
  assert start and all("lora" in p or "score_head" in p for p in start), sorted(start)
  trainer.train()
  end = flat(trainer.state.params)
  moved = {p for p in start if np.any(end[p] != start[p])}
  assert any("score_head" in p for p in moved) and any("lora" in p for p in moved), moved
  for p, v in flat(trainer.rest).items():  # the base weights stay frozen
    np.testing.assert_array_equal(v, rest[p], err_msg=p)
  pairs = trainer.train_pairs
  trainer.normalise(input_ids=pairs.chosen_ids, attention_mask=pairs.chosen_mask)
  scores = trainer.score(pairs.chosen_ids, pairs.chosen_mask)
  np.testing.assert_allclose([scores.mean(), scores.std()], [0.0, 1.0], atol=2e-5)


def test_consecutive_non_finite_steps_stop_the_run():
  from jax_ppo.training import NonFiniteUpdates

  config = RewardModelConfig(batch_size=4, total_steps=5, eos_token_id=EOS,
                             max_consecutive_skips=2)
  trainer = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                               train_data=_toy_records(8, 5))
  start = jax.tree.map(np.asarray, trainer.state.params)
  trainer.train_pairs = trainer.train_pairs.replace(
      margin=np.full_like(trainer.train_pairs.margin, np.nan))  # past the data checks
  with pytest.raises(NonFiniteUpdates, match="max_consecutive_skips=2"):
    trainer.train()
  assert trainer.step_count == 2
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
               trainer.state.params, start)


def test_sigint_during_reward_model_training_checkpoints_and_resumes_exactly(tmp_path):
  """Preemption of the reward-model stage: SIGINT during `train()` ends the call after a
  checkpoint (`preempted`), and the rerun ends bit-equal to an uninterrupted run."""
  import os
  import signal

  def make(run_dir=None):  # save_every=10: the only checkpoint is the one the signal writes
    return _run_trainer(run_dir, save_every=10)

  straight = make()
  straight.train()
  calls = []

  def preempt(metrics):
    calls.append(metrics)
    if len(calls) == 1:
      os.kill(os.getpid(), signal.SIGINT)

  with make(tmp_path / "run") as first:
    history = first.train(callback=preempt)
  assert history.preempted == "SIGINT" and first.step_count == 1
  with make(tmp_path / "run") as resumed:
    assert resumed.step_count == 1
    resumed.train()
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, straight.state),
               jax.tree.map(np.asarray, resumed.state))
