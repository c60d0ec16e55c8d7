"""`RewardModelTrainer`: learning a toy preference, records of text, chats and ids, the held-out
split, reward normalisation through export, resume and preemption, LoRA, the non-finite stop,
bad inputs."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo import models
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.hf import SCORE_BIAS_KEY
from jax_ppo.reward_model import (
    NORMALISATION_FILE,
    RewardModelConfig,
    RewardModelOptimizer,
    RewardModelTrainer,
    preference_pairs,
)
from jax_ppo.training import RunOptions
from tests.preference_toys import EOS, MODEL, toy_records
from tests.reward_model.test_pairwise import pad_row

# Trainers with identical programs load them from the cache instead of recompiling.
pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def test_learns_a_toy_preference_to_high_held_out_accuracy():
  config = RewardModelConfig(batch_size=32, total_steps=25, eos_token_id=EOS, max_length=16,
                             eval_every=25, optimizer=RewardModelOptimizer(
                                 learning_rate=3e-3, lr_schedule="constant"))
  trainer = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                               train_data=toy_records(256, 0), eval_data=toy_records(128, 1))
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


def word_tokenizer(path):
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
  tok = word_tokenizer(tmp_path / "tok")
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

  tok = word_tokenizer(tmp_path / "tok")
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
  records = toy_records(20, 4)
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

  tok = word_tokenizer(tmp_path / "tok")
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
  rows = [pad_row(list(rng.integers(3, 160, size=n)), 10, side)
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
                            train_data=toy_records(40, 2), run_dir=run_dir,
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


def test_bad_data_errors_name_the_record_and_field():
  model = ScalarModel(MODEL, rngs=nnx.Rngs(0))
  config = RewardModelConfig(batch_size=2, total_steps=1, eos_token_id=EOS)

  def trainer(data, **kw):
    return RewardModelTrainer(config, model, train_data=data, **kw)

  good = {"prompt": [3, 4], "chosen": [5], "rejected": [6]}
  with pytest.raises(ValueError, match=r"train_data\[1\]: expected an object with \"prompt\", "
                     r"\"chosen\" and \"rejected\" fields, got keys "
                     r"\['prompt', 'chosen', 'reject'\]; rename 'reject' to \"rejected\" \(or pass "
                     r"RewardModelConfig.rejected_field='reject'\)"):
    trainer([good, {"prompt": [3], "chosen": [5], "reject": [6]}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.chosen holds text but no tokenizer"):
    trainer([{"prompt": [3], "chosen": "good", "rejected": [6]}])
  with pytest.raises(ValueError, match=r"train_data\[0\]\.rejected .*\[0, 24\)"):
    trainer([{"prompt": [3], "chosen": [5], "rejected": [99]}])
  with pytest.raises(ValueError, match=r"eval_data\[0\]: \"margin\" must be a finite number >= 0, "
                     r"got 'big' \(str\)"):
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
  trainer = RewardModelTrainer(config, model, train_data=toy_records(32, 3))
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
                               train_data=toy_records(8, 5))
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


def test_a_multi_process_job_without_a_mesh_is_refused(monkeypatch, tmp_path):
  """Several processes each training the whole model on their own devices would be several
  different runs: without a mesh the trainer and the config-file run refuse, naming the fix
  (the run before it loads any model)."""
  from jax_ppo.parallel import distributed
  from jax_ppo.runs import reward as reward_run

  monkeypatch.setattr(distributed, "multi_process", lambda: True)
  config = RewardModelConfig(batch_size=2, total_steps=1, eos_token_id=EOS)
  with pytest.raises(ValueError, match=r"multi-process run trains on one device mesh .*mesh\.data"):
    RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                       train_data=[{"prompt": [3], "chosen": [4], "rejected": [5]}])
  (tmp_path / "model").mkdir()  # (apart from the run folder: jax_ppo.runs.paths)
  (tmp_path / "model" / "config.json").write_text("{}")  # (never read: the mesh is checked first)
  run = reward_run.RewardRunConfig(model_path=str(tmp_path / "model"), train_path="p.jsonl",
                                   run_dir=str(tmp_path / "run"))
  with pytest.raises(ValueError, match=r"RewardRunConfig\.mesh=None, but this is one of several "
                                       r"processes"):
    reward_run.build_reward_trainer(run)


def test_pairs_cut_to_max_length_are_named_and_counted(caplog):
  """The start of a too-long pair is cut (the score is read at its last token); one warning
  names the cut records, and `cut_records` counts them by argument."""
  config = RewardModelConfig(batch_size=2, total_steps=1, eos_token_id=EOS, max_length=4,
                             add_eos=False)
  long = {"prompt": [3, 4, 5], "chosen": [6, 7], "rejected": [8]}
  short = {"prompt": [3], "chosen": [6], "rejected": [8]}
  with caplog.at_level("WARNING", logger="jax_ppo.data"):
    t = RewardModelTrainer(config, ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                           train_data=[short, long, short], eval_data=[long])
  assert t.cut_records == {"train_data": 1, "eval_data": 1}
  assert np.asarray(t.train_pairs.chosen_ids)[1].tolist() == [4, 5, 6, 7]
  warnings = [r.getMessage() for r in caplog.records]
  assert warnings == [
      "1 of 3 preference pairs of train_data are longer than max_length=4; their starts were cut "
      "(the score is read at the last token) (raise max_length to keep them whole). Cut: "
      "train_data[1]",
      "1 of 1 preference pairs of eval_data are longer than max_length=4; their starts were cut "
      "(the score is read at the last token) (raise max_length to keep them whole). Cut: "
      "eval_data[0]"]
