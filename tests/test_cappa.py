"""CapPa in VirTex (`configs/virtex.py:task=cappa`): the per-example parallel-prediction inputs and masks, the
share drawn, caption log-likelihood scoring, and a tiny run that trains, resumes, captions and exports."""

import json
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_tiny_config, run_main

from vlrep import methods
from vlrep.models import special_tokens

VOCAB = 60


def _captions(n: int = 8, t: int = 12, seed: int = 0) -> np.ndarray:
  """[SOS] words [EOS] [PAD].. of lengths 3..n+2 (the longest fills the row)."""
  rng = np.random.default_rng(seed)
  tokens = np.zeros((n, t), np.int32)
  for i in range(n):
    k = min(3 + i, t)
    tokens[i, :k] = [
      special_tokens.SOS_ID,
      *rng.integers(special_tokens.NUM_SPECIAL, VOCAB, k - 2),
      special_tokens.EOS_ID,
    ]
  return tokens


def _method(task="cappa", **method):
  cfg = load_tiny_config(f"task={task}").method
  cfg.update(method)
  return methods.build(cfg, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def cappa():
  """A tiny CapPa method, its initial variables and a batch of 8 captions."""
  method = _method()
  rng = np.random.default_rng(1)
  batch = {"image": jnp.asarray(rng.normal(size=(8, 32, 32, 3)), jnp.float32), "tokens": jnp.asarray(_captions())}
  return method, jax.jit(method.init)(jax.random.PRNGKey(0), batch), batch


def test_recipe_argument_sets_the_papers_fraction_and_the_captioning_evaluator():
  c = load_tiny_config("task=cappa")
  assert c.method.task == "cappa" and c.method.cappa_parallel_fraction == 0.75
  assert c.evals.captioning.type == "captioning"
  with pytest.raises(ValueError, match="cappa_parallel_fraction"):
    _method(cappa_parallel_fraction=1.5)


def test_parallel_rows_get_only_mask_tokens_and_no_padding_and_the_share_follows_the_fraction():
  from vlrep.methods.virtex import cappa_inputs

  tokens = jnp.asarray(_captions(64))
  inputs, padding, parallel = (np.asarray(x) for x in cappa_inputs(tokens, jax.random.PRNGKey(3), 0.5))
  prefix = np.asarray(tokens)[:, :-1]
  assert 0 < parallel.sum() < 64
  assert (inputs[parallel] == special_tokens.MASK_ID).all() and not padding[parallel].any()
  np.testing.assert_array_equal(inputs[~parallel], prefix[~parallel])  # teacher forcing: [SOS] c1..cT
  np.testing.assert_array_equal(padding[~parallel], prefix[~parallel] == special_tokens.PAD_ID)
  # The share over many draws: 20,000 examples put the binomial's std at 0.003.
  many = jnp.zeros((20_000, 4), jnp.int32)
  for fraction in (0.75, 0.3):
    share = float(jnp.mean(cappa_inputs(many, jax.random.PRNGKey(4), fraction)[2]))
    assert abs(share - fraction) < 0.015, (fraction, share)
  assert not cappa_inputs(many, jax.random.PRNGKey(5), 0.0)[2].any()
  assert cappa_inputs(many, jax.random.PRNGKey(5), 1.0)[2].all()


def test_parallel_rows_attend_to_later_positions_and_autoregressive_rows_do_not(cappa):
  method, variables, batch = cappa
  tokens = np.asarray(batch["tokens"])[:2, :-1].copy()
  tokens[:, 6:] = 7  # no padding: a later position's input is seen wherever the mask lets it
  causal = jnp.asarray([False, True])  # row 0 parallel, row 1 autoregressive

  def logits(tokens, causal_by_direction):
    tokens = jnp.asarray(tokens)
    out, _ = method.model.apply(
      variables,
      batch["image"][:2],
      {"forward": tokens},
      {"forward": tokens == special_tokens.PAD_ID},
      False,
      causal_by_direction,
    )
    return np.asarray(out["forward"])

  base = logits(tokens, {"forward": causal})
  changed = tokens.copy()
  changed[:, 8] = 11
  after = logits(changed, {"forward": causal})
  assert np.abs(after[0, :8] - base[0, :8]).max() > 1e-4  # parallel: position 8 reaches every output
  np.testing.assert_array_equal(after[1, :8], base[1, :8])  # causal: outputs before 8 cannot see it
  # Every row causal is exactly the head without per-example masks (every other task's numbers).
  np.testing.assert_array_equal(logits(tokens, {"forward": jnp.ones(2, bool)}), logits(tokens, None))


def test_loss_is_captioning_at_fraction_0_and_all_mask_parallel_prediction_at_fraction_1(cappa):
  _, variables, batch = cappa
  rng = jax.random.PRNGKey(9)
  captioning = _method("captioning").loss(variables, batch, rng, True)[0]
  cappa0, metrics0, _ = _method(cappa_parallel_fraction=0.0).loss(variables, batch, rng, True)
  assert float(cappa0) == float(captioning)  # the same draws of dropout: bit-identical
  assert float(metrics0["parallel_share"]) == 0.0 and float(metrics0["autoregressive_loss"]) == float(cappa0)

  method = _method(cappa_parallel_fraction=1.0)
  loss, metrics, _ = method.loss(variables, batch, rng, False)
  assert float(metrics["parallel_share"]) == 1.0 and float(metrics["parallel_loss"]) == pytest.approx(float(loss))
  tokens = np.asarray(batch["tokens"])
  masks = jnp.full(tokens[:, :-1].shape, special_tokens.MASK_ID)
  out, _ = method.model.apply(
    variables,
    batch["image"],
    {"forward": masks},
    {"forward": jnp.zeros(masks.shape, bool)},
    False,
    {"forward": jnp.zeros(len(tokens), bool)},
  )
  logp = jax.nn.log_softmax(np.asarray(out["forward"]), -1)
  targets = tokens[:, 1:]
  nll = -np.take_along_axis(np.asarray(logp), targets[..., None], -1)[..., 0]
  keep = targets != special_tokens.PAD_ID
  assert float(loss) == pytest.approx(nll[keep].mean(), rel=1e-5)


def test_caption_log_likelihood_is_the_teacher_forced_sum_up_to_eos(cappa):
  method, variables, batch = cappa
  tokens = np.asarray(batch["tokens"])
  scores = np.asarray(jax.jit(method.caption_log_likelihood)(variables, batch["image"], batch["tokens"]))
  assert scores.shape == (8,) and scores.dtype == np.float32
  # Directly: the forward head's logits over the teacher-forced prefix, inference BatchNorm, no dropout.
  inputs = jnp.asarray(tokens[:, :-1])
  out, _ = method.model.apply(variables, batch["image"], {"forward": inputs}, {"forward": inputs == 0}, False)
  logp = np.asarray(jax.nn.log_softmax(out["forward"], -1), np.float64)
  direct = []
  for row, lp in zip(tokens, logp, strict=True):
    end = list(row).index(special_tokens.EOS_ID)  # [EOS] included, nothing after it
    direct.append(sum(lp[j - 1, row[j]] for j in range(1, end + 1)))
  np.testing.assert_allclose(scores, direct, rtol=1e-5)
  assert (scores < 0).all() and scores[0] > scores[-1]  # longer captions: more terms, each negative
  # Whatever follows [EOS] changes nothing (the causal mask and the sum both stop there).
  junk = np.where(tokens == special_tokens.PAD_ID, 9, tokens)
  junk_scores = np.asarray(jax.jit(method.caption_log_likelihood)(variables, batch["image"], jnp.asarray(junk)))
  np.testing.assert_allclose(junk_scores, scores, rtol=1e-6)
  for task in ("masked_lm", "token_classification"):
    with pytest.raises(ValueError, match="no caption likelihood"):
      _method(task).caption_log_likelihood(variables, batch["image"], batch["tokens"])


def test_cappa_trains_resumes_captions_and_exports(tmp_path):
  """Two steps; a restart that resumes to four and runs the recipe's evaluators, the captioning one decoding
  autoregressively; the backbone's Detectron2 export (the ImageNet stem: the small one has no Detectron2 layout)."""
  from vlrep.interop import export

  workdir = tmp_path / "run"
  config = "tests/tiny_virtex.py:task=cappa"
  stem = "--config.method.backbone.stem=imagenet"
  first = run_main(workdir, "--config.total_steps=2", "--config.evals={}", stem, config=config)
  assert first.returncode == 0, first.stderr[-3000:]
  second = run_main(workdir, "--config.total_steps=4", stem, config=config)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "Resumed from step 2" in second.stderr
  for key in ("train/parallel_loss", "train/autoregressive_loss", "train/parallel_share"):
    assert f"{key}=" in second.stderr, key  # each logged step's metrics
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 4 and np.isfinite(summary["train/loss"])
  for key in ("captioning/cider", "captioning/bleu4", "captioning/mean_length", "probe/map"):
    assert key in summary and np.isfinite(summary[key]), key

  out = tmp_path / "backbone.pkl"
  info = export.export(str(workdir), "detectron2", str(out), "latest")
  assert info["step"] == 4 and info["keys"] > 0
  with open(out, "rb") as f:
    assert "stem.conv1.weight" in pickle.load(f)["model"]
