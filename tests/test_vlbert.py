"""VisualBERT / ViLBERT (the pretraining study): metrics, masking, region sampling, BERT loading, weight
distances, bad inputs, and pretrain -> fine-tune end to end."""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, run_main
from ml_collections import ConfigDict

from vlrep.data import registry
from vlrep.evaluators import _vl_metrics
from vlrep.methods import vlbert
from vlrep.models import bert as bert_lib
from vlrep.models import vl_bert
from vlrep.tools import weight_distance


@pytest.fixture(scope="module")
def minilm():
  return bert_lib.load_pretrained("minilm")


# ---------------------------------------------------------------------------------------------------------
# Metrics.
# ---------------------------------------------------------------------------------------------------------
def test_vqa_accuracy_and_soft_scores_on_hand_made_annotations():
  humans = ["yes"] * 3 + ["no"] * 7
  # Leaving out one of the 3 'yes' humans leaves 2 matches (2/3); leaving out a 'no' leaves 3 (1).
  assert _vl_metrics.answer_score(humans, "yes") == pytest.approx((3 * 2 / 3 + 7 * 1.0) / 10)
  assert _vl_metrics.answer_score(humans, "no") == 1.0
  assert _vl_metrics.answer_score(humans, "maybe") == 0.0
  one = ["two"] + ["red"] * 9  # a single 'two': 0 when its human is left out, 1/3 otherwise
  assert _vl_metrics.answer_score(one, "2") == pytest.approx(9 / 10 * (1 / 3))
  # Official normalisation: number words, articles, punctuation, case.
  assert _vl_metrics.normalize_answer("The Dog.") == "dog"
  assert _vl_metrics.normalize_answer("Two") == "2"
  assert _vl_metrics.vqa_accuracy(["no", "yes"], [humans, humans]) == pytest.approx(100 * (1.0 + 0.9) / 2)
  vocab = _vl_metrics.build_answer_vocab([humans, one, ["Yes", "blue"]], size=3)
  assert vocab == ["red", "no", "yes"]  # by count (9, 7, 4), ties alphabetical
  scores, known = _vl_metrics.soft_scores(humans, {a: i for i, a in enumerate(vocab)})
  np.testing.assert_allclose(scores, [0.0, 1.0, 0.9], rtol=1e-6)
  assert known
  scores, known = _vl_metrics.soft_scores(["purple"] * 10, {a: i for i, a in enumerate(vocab)})
  assert not known and not scores.any()  # out of vocabulary: an all-zero row, counted by the op


def test_f1_scores_match_scikit_learn():
  metrics = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(0)
  y = rng.random((200, 23)) < 0.15
  p = rng.random((200, 23)) < 0.2
  y[:, 5] = False  # a class with no positives: F1 0 with zero_division=0
  p[:, 5] = False
  got = _vl_metrics.f1_scores(p, y)
  assert got["micro_f1"] == pytest.approx(100 * metrics.f1_score(y, p, average="micro", zero_division=0))
  assert got["macro_f1"] == pytest.approx(100 * metrics.f1_score(y, p, average="macro", zero_division=0))


def test_weight_distances_on_known_matrices():
  a = np.array([[1.0, 0.0], [0.0, 0.0]])
  assert weight_distance.l1_distance(a, a + 0.5) == pytest.approx(0.5)
  assert weight_distance.angular_distance(a, 3 * a) == pytest.approx(0.0, abs=1e-7)
  assert weight_distance.angular_distance(a, np.array([[0.0, 1.0], [0.0, 0.0]])) == pytest.approx(0.5)
  assert weight_distance.angular_distance(a, -a) == pytest.approx(1.0)

  def layer(scale):
    return {k: {"kernel": np.full((2, 2), scale)} for k in weight_distance.ATTENTION}

  pre = {"bert": {"layer_0": layer(1.0), "layer_1": layer(1.0)}, "v_layer_0": layer(1.0)}
  fine = {"bert": {"layer_0": layer(1.0), "layer_1": layer(3.0)}, "v_layer_0": layer(-1.0)}
  d = weight_distance.layer_distances(pre, fine)
  assert list(d) == ["t0", "t1", "v0"]
  assert d["t0"] == {"l1": 0.0, "angular": 0.0}
  assert d["t1"]["l1"] == pytest.approx(2.0) and d["t1"]["angular"] == pytest.approx(0.0, abs=1e-7)
  assert d["v0"]["l1"] == pytest.approx(2.0) and d["v0"]["angular"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------
# Masking and regions.
# ---------------------------------------------------------------------------------------------------------
def test_bert_masking_rates():
  tokens = jnp.asarray(np.random.default_rng(0).integers(1000, 2000, (400, 128)), jnp.int32)
  special = jnp.zeros(tokens.shape, bool).at[:, 0].set(True).at[:, 100:].set(True)  # [CLS] and padding
  out, picked = vlbert.bert_mask(jax.random.PRNGKey(0), tokens, special, 0.15, 30522, 103)
  out, picked, tokens, special = (np.asarray(x) for x in (out, picked, tokens, special))
  assert not (picked & special).any() and (out[special] == tokens[special]).all()
  assert (out[~picked] == tokens[~picked]).all()
  assert picked[~special].mean() == pytest.approx(0.15, abs=0.005)  # 39600 eligible tokens
  assert (picked.sum(1) <= vlbert.max_predictions(128, 0.15)).all()
  masked = (out == 103)[picked].mean()
  kept = (out == tokens)[picked].mean()
  replaced = 1 - masked - kept  # a random token equal to the original (1 in 30522) counts as kept
  assert masked == pytest.approx(0.8, abs=0.02)
  assert kept == pytest.approx(0.1, abs=0.015) and replaced == pytest.approx(0.1, abs=0.015)


def test_region_kl_on_hand_computed_distributions():
  logits = jnp.array([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [3.0, 0.0, 0.0]]])
  probs = jnp.array([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 0.0]]])  # region 3: no distribution
  weights = jnp.array([[1.0, 1.0, 1.0]])
  log_q0 = np.array([0.0, 1.0, 2.0]) - np.log(1 + np.e + np.e**2)
  kl0 = 0.5 * (np.log(0.5) - log_q0[0]) + 0.5 * (np.log(0.5) - log_q0[1])  # the zero entry adds nothing
  kl1 = sum(p * np.log(p / (1 / 3)) for p in (0.2, 0.3, 0.5))  # against the uniform prediction
  got = float(vlbert.region_kl(logits, probs, weights))
  assert got == pytest.approx((kl0 + kl1) / 2, rel=1e-5)  # the region without a distribution is left out
  assert float(vlbert.region_kl(logits, probs, jnp.array([[0.0, 1.0, 1.0]]))) == pytest.approx(kl1, rel=1e-5)


def test_roi_sample_is_bilinear_in_box_coordinates():
  h, w = 6, 8
  ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  maps = jnp.asarray(np.stack([ys, xs], -1)[None].astype(np.float32))  # channel 0 = row, 1 = column
  boxes = jnp.asarray([[[0.25, 0.25, 0.75, 0.75]]])
  out = np.asarray(vl_bert.roi_sample(maps, boxes, 2))[0, 0]  # samples at box fractions 1/4 and 3/4
  # Pixel-centre coordinates: y = (0.25 + 0.5 * f) * 6 - 0.5 for f in (0.25, 0.75) -> 1.75, 3.25.
  np.testing.assert_allclose(out[:, 0, 0], [1.75, 3.25], atol=1e-6)
  np.testing.assert_allclose(out[0, :, 1], [2.5, 4.5], atol=1e-6)
  whole = np.asarray(vl_bert.roi_sample(maps, jnp.asarray([[[0.0, 0.0, 1.0, 1.0]]]), h))[0, 0]
  np.testing.assert_allclose(whole[:, 0, 0], np.arange(h), atol=1e-6)  # a full-image box at native size: identity


# ---------------------------------------------------------------------------------------------------------
# Models and BERT loading.
# ---------------------------------------------------------------------------------------------------------
def _model(arch, cfg, **kw):
  return vl_bert.VLBertModel(
    arch=arch,
    bert=cfg,
    v_layers=1,
    v_hidden=32,
    v_heads=2,
    v_intermediate=64,
    bi_hidden=32,
    bi_heads=2,
    region_dim=16,
    **kw,
  )


def _inputs(rng, b=2, t=7, n=3):
  tokens = np.zeros((b, t), np.int32)
  tokens[:, :5] = [101, 1037, 2417, 2675, 102]  # [CLS] a red square [SEP]
  tokens[1, 3] = 4418  # a different word in the second caption
  regions = rng.normal(size=(b, n, 16)).astype(np.float32)
  boxes = np.tile(np.array([0.1, 0.2, 0.5, 0.7], np.float32), (b, n, 1))
  return jnp.asarray(tokens), jnp.zeros((b, t), jnp.int32), jnp.asarray(regions), jnp.asarray(boxes)


def test_visual_bert_without_regions_is_exactly_the_loaded_bert(minilm):
  cfg, enc, _, _ = minilm
  model = _model("visual_bert", cfg)
  tokens, types, regions, boxes = _inputs(np.random.default_rng(0))
  mask = jnp.ones(regions.shape[:2], bool)
  params = dict(model.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"])
  random_bert = params["bert"]
  params["bert"] = jax.tree.map(jnp.asarray, enc)
  encode = lambda p, m: model.apply({"params": p}, tokens, types, regions, boxes, m, method=model.encode)[0]
  # With every region masked out, the text states are BERT's hidden states, to float tolerance.
  want, _ = bert_lib.BertEncoder(cfg).apply({"params": enc}, tokens, tokens != 0, types)
  got = encode(params, jnp.zeros_like(mask))
  keep = np.asarray(tokens != 0)
  np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], atol=2e-5)
  # The regions are read (visible regions change the text states), and the loaded weights matter.
  assert np.abs(np.asarray(encode(params, mask) - got))[keep].max() > 1e-3
  unloaded = encode(dict(params, bert=random_bert), mask)
  assert np.abs(np.asarray(unloaded - encode(params, mask)))[keep].max() > 0.1


def test_vilbert_uses_the_loaded_bert_and_co_attention(minilm):
  cfg, enc, _, _ = minilm
  cfg2 = bert_lib.BertConfig(**{**cfg.__dict__, "num_hidden_layers": 2})
  # Its first 2 layers; ViLBERT pools the text with its own t_pooler, so BERT's pooler is not part of it.
  enc2 = {k: v for k, v in enc.items() if k not in {"pooler", *(f"layer_{i}" for i in range(2, cfg.num_hidden_layers))}}
  model = _model("vilbert", cfg2, region_classes=5, num_labels=3)
  tokens, types, regions, boxes = _inputs(np.random.default_rng(1))
  mask = jnp.ones(regions.shape[:2], bool)
  params = dict(model.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"])
  assert set(params) >= {"bert", "v_layer_0", "co_layer_0", "t_pooler", "v_pooler", "mlm_head", "region_head_2"}
  assert jax.tree.structure(params["bert"]) == jax.tree.structure(enc2)
  loaded = dict(params, bert=jax.tree.map(jnp.asarray, enc2))
  run = lambda p, r: model.apply({"params": p}, tokens, types, r, boxes, mask)
  a, b = run(loaded, regions), run(params, regions)
  assert np.abs(np.asarray(a["mlm_logits"] - b["mlm_logits"])).max() > 0.1  # the BERT weights are used
  c = run(loaded, regions + 1.0)
  assert np.abs(np.asarray(a["mlm_logits"] - c["mlm_logits"])).max() > 1e-3  # text sees the regions
  assert a["region_outputs"].shape == (2, 4, 5) and a["task_logits"].shape == (2, 3)  # [IMG] + 3 regions
  # An image without regions ([IMG] only, mean over nothing = 0) stays finite.
  empty = model.apply({"params": loaded}, tokens, types, regions, boxes, jnp.zeros_like(mask))
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(empty))


def test_text_pool_mean_reads_the_sentence_where_minilms_cls_does_not(minilm):
  cfg, enc, _, folder = minilm
  cfg2, enc2 = bert_lib.first_layers(cfg, enc, 2, folder)  # runlocal's 2 layers
  tokens, types, regions, boxes = _inputs(np.random.default_rng(3))
  mask = jnp.ones(regions.shape[:2], bool)
  cos = lambda p: float(p[0] @ p[1] / (np.linalg.norm(p[0]) * np.linalg.norm(p[1])))
  pooled = {}
  for pool in vl_bert.TEXT_POOLS:
    model = _model("visual_bert", cfg2, text_pool=pool)
    params = dict(model.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"])
    params["bert"] = jax.tree.map(jnp.asarray, enc2)
    t, _, pooled[pool], _ = model.apply({"params": params}, tokens, types, regions, boxes, mask, method=model.encode)
    if pool == "mean":  # BERT's pooler over the mean of the 5 real tokens' states; padding left out
      p = params["bert"]["pooler"]
      want = np.tanh(np.asarray(t)[:, :5].mean(1) @ np.asarray(p["kernel"]) + np.asarray(p["bias"]))
      np.testing.assert_allclose(np.asarray(pooled[pool]), want, atol=1e-5)
  # "a red square" vs "a red circle": MiniLM's [CLS] (never trained) is the same vector for both; the mean is not.
  assert cos(np.asarray(pooled["cls"])) > 0.999
  assert cos(np.asarray(pooled["mean"])) < 0.99
  with pytest.raises(ValueError, match="text_pool"):
    _model("vilbert", cfg2, text_pool="max").init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)


def test_vilbert_fusion_is_the_product_or_the_sum_of_the_pooled_streams(minilm):
  cfg, enc, _, folder = minilm
  cfg2, _ = bert_lib.first_layers(cfg, enc, 2, folder)
  tokens, types, regions, boxes = _inputs(np.random.default_rng(4))
  mask = jnp.ones(regions.shape[:2], bool)
  params = _model("vilbert", cfg2).init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"]
  out = {}
  for fusion in vl_bert.FUSIONS:  # the same parameters: fusion adds none
    model = _model("vilbert", cfg2, fusion=fusion)
    _, _, out[fusion], aux = model.apply({"params": params}, tokens, types, regions, boxes, mask, method=model.encode)
  t, v = np.asarray(aux["t_pooled"]), np.asarray(aux["v_pooled"])
  assert (t > 0).any() and (v > 0).any()
  np.testing.assert_allclose(np.asarray(out["mul"]), t * v, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out["sum"]), t + v, rtol=1e-6)
  with pytest.raises(ValueError, match="fusion"):
    _model("vilbert", cfg2, fusion="concat").init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)


def test_dropout_only_while_training_and_in_each_stream_where_vilbert_puts_it(minilm):
  """Evaluation (deterministic) and rate 0 are the same function; rate 0.1 changes both archs' outputs and the
  task head's; in a co-attention block the text stream's dropout moves only the text states and the visual
  stream's only what depends on it (the text's attention over the regions uses the visual attention rate)."""
  cfg, _, _, _ = minilm
  cfg = bert_lib.first_layers(cfg, {}, 1)[0]
  assert (cfg.hidden_dropout_prob, cfg.attention_probs_dropout_prob) == (0.1, 0.1)
  off = bert_lib.with_dropout(cfg, 0.0)
  tokens, types, regions, boxes = _inputs(np.random.default_rng(2))
  mask = jnp.ones(regions.shape[:2], bool)
  keep = np.asarray(tokens != 0)
  for arch in ("visual_bert", "vilbert"):
    model = _model(arch, cfg, num_labels=3)
    params = model.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"]

    def encode(model, deterministic, seed=0):
      rngs = {"dropout": jax.random.PRNGKey(seed)}
      out = model.apply({"params": params}, tokens, types, regions, boxes, mask, deterministic,
                        method=model.encode, rngs=rngs)  # fmt: skip
      logits = model.apply({"params": params}, out[2], deterministic, method=model.task_logits, rngs=rngs)
      return np.asarray(out[0]), np.asarray(logits)

    clean = encode(model, True)
    for got, want in zip(encode(_model(arch, off, num_labels=3), False), clean, strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    dropped = encode(model, False)
    assert np.abs(dropped[0] - clean[0])[keep].max() > 1e-2, arch
    assert np.abs(dropped[1] - clean[1]).max() > 1e-3, arch
    assert np.abs(dropped[0] - encode(model, False, seed=1)[0])[keep].max() > 1e-2, arch
  # One co-attention block, each stream's rates alone.
  rng = np.random.default_rng(3)
  t, v = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32), jnp.asarray(rng.normal(size=(2, 4, 32)), jnp.float32)
  t_mask, v_mask = jnp.ones((2, 5), bool), jnp.ones((2, 4), bool)

  def block(text_dropout=(0.0, 0.0), visual_dropout=(0.0, 0.0)):
    b = vl_bert.CoAttentionBlock(32, 32, 32, 2, 64, 64, text_dropout=text_dropout, visual_dropout=visual_dropout)
    p = vl_bert.CoAttentionBlock(32, 32, 32, 2, 64, 64).init(jax.random.PRNGKey(0), t, t_mask, v, v_mask)
    out = b.apply(p, t, t_mask, v, v_mask, False, rngs={"dropout": jax.random.PRNGKey(1)})
    return [np.asarray(x) for x in out]

  t0, v0 = block()
  changed = lambda a, b: np.abs(a - b).max() > 1e-3
  t1, v1 = block(visual_dropout=(0.5, 0.0))  # the visual stream's residual branches
  assert not changed(t1, t0) and changed(v1, v0)
  t2, v2 = block(visual_dropout=(0.0, 0.5))  # the text's attention weights over the regions
  assert changed(t2, t0) and not changed(v2, v0)
  t3, v3 = block(text_dropout=(0.5, 0.0))
  assert changed(t3, t0) and not changed(v3, v0)
  t4, v4 = block(text_dropout=(0.0, 0.5))  # the regions' attention weights over the text
  assert not changed(t4, t0) and changed(v4, v0)


# ---------------------------------------------------------------------------------------------------------
# Data ops and bad inputs.
# ---------------------------------------------------------------------------------------------------------
def test_pair_tokenization_answer_targets_and_counted_skips():
  from vlrep.data import vl_ops
  from vlrep.data.wordpiece import WordPieceTokenizer

  tok = WordPieceTokenizer(bert_lib.resolve_path("minilm"))
  ids, types, truncated = vl_ops.encode_pair(tok, "is there a cube?", "yes", 12)
  pieces = [tok.pieces[i] for i in ids if i]
  assert pieces == ["[CLS]", "is", "there", "a", "cube", "?", "[SEP]", "yes", "[SEP]"] and not truncated
  np.testing.assert_array_equal(types[:9], [0] * 7 + [1] * 2)
  ids, _, truncated = vl_ops.encode_pair(tok, "one two three four five six", "seven eight", 8)
  assert truncated  # the longer segment (a) loses pieces first
  assert [tok.pieces[i] for i in ids] == ["[CLS]", "one", "two", "three", "[SEP]", "seven", "eight", "[SEP]"]

  context = {"tokenizer": tok, "answer_vocab": ["yes", "no", "2"]}
  pp = registry.parse("tokenize_pairs(10)|answer_targets", context)
  batch = {
    "text_a": np.array([["is it red?", ""], ["", "how many?"]], object),
    "text_b": np.array([["", ""], ["", ""]], object),
    "answers": np.array([[["yes"], [""]], [["no"], ["purple"]]], object),
    "pair_mask": np.array([[True, False], [True, True]]),
  }
  out = pp.batch_fn(batch)
  assert out["tokens"].shape == (2, 2, 10) and out["targets"].shape == (2, 2, 3)
  # The empty question of image 1 is skipped (mask cleared) and counted; the padded pair is neither.
  np.testing.assert_array_equal(out["pair_mask"], [[True, False], [False, True]])
  assert out["stat_empty"].sum() == 1
  np.testing.assert_array_equal(out["targets"][0, 0], [1, 0, 0])
  # 'purple' is outside the vocabulary: an all-zero target, counted.
  assert out["stat_answer_oov"].sum() == 1 and not out["targets"][1, 1].any()


def test_regions_and_pairs_ops_on_an_image_without_objects_or_questions():
  import tensorflow as tf

  pp = registry.parse("regions_from_objects(3)|vl_pairs('qa', 2, sample=False)")
  ex = {
    "objects": {"bbox": tf.zeros([0, 4]), "label": tf.zeros([0], tf.int64)},
    "questions": {"question": tf.zeros([0], tf.string), "answer": tf.zeros([0], tf.string)},
    "_rng": tf.zeros([2], tf.int64),
  }
  out = pp.example_fn(ex)
  assert not out["box_mask"].numpy().any() and (out["region_labels"].numpy() == -1).all()
  assert not out["pair_mask"].numpy().any() and out["text_a"].shape == (2,)


def test_num_labels_from_the_answer_vocabulary_and_clear_errors():
  cfg = ConfigDict(
    {
      "task": "classify",
      "loss": "bce",
      "num_labels": -1,
      "arch": "visual_bert",
      "bert_path": "minilm",
      "bert_layers": 1,
    }
  )
  with pytest.raises(ValueError, match="answer vocabulary"):
    vlbert.Method(cfg, 30522)
  with pytest.raises(ValueError, match="tokenizer has 100 tokens"):
    vlbert.Method(cfg, 100, ["yes"])
  with pytest.raises(ValueError, match="Unknown vlbert task"):
    vlbert.Method(ConfigDict({**cfg.to_dict(), "task": "nsp"}), 30522)


def test_alignment_scores_masked_tokens_on_aligned_pairs_and_trains_the_poolers():
  """ViLBERT's alignment objective (method.alignment_weight): half the texts meet the batch's next image, the
  masked losses score only the aligned pairs, and the alignment head's loss trains both poolers."""
  import tiny_vlbert

  c = tiny_vlbert.get_config("arch=vilbert,stage=pretrain")
  c.method.alignment_weight = -1.0
  with pytest.raises(ValueError, match="alignment_weight must be >= 0"):
    vlbert.Method(c.method, 30522)
  c.method.alignment_weight = 0.0
  without = vlbert.Method(c.method, 30522)
  c.method.alignment_weight = 1.0
  method = vlbert.Method(c.method, 30522)
  b, t = 8, 8
  rng = np.random.default_rng(0)
  colours = rng.uniform(-2, 2, (b, 1, 1, 3)).astype(np.float32)
  tokens = np.zeros((b, 1, t), np.int32)
  # Eight different captions, three maskable words each.
  tokens[:, 0, :5] = [[101, w, w, w, 102] for w in (2417, 2630, 2665, 3756, 2304, 2317, 5061, 4589)]
  batch = {
    "image": jnp.asarray(np.broadcast_to(colours, (b, 32, 32, 3))),  # image i: one colour
    "boxes": jnp.tile(jnp.array([0.0, 0.0, 1.0, 1.0]), (b, 4, 1)),
    "box_mask": jnp.asarray(np.arange(4)[None].repeat(b, 0) < 2),
    "region_labels": jnp.zeros((b, 4), jnp.int32),
    "tokens": jnp.asarray(tokens),
    "type_ids": jnp.zeros_like(tokens),
    "pair_mask": jnp.ones((b, 1), bool),
  }
  variables = method.init(jax.random.PRNGKey(0), batch)
  assert (
    "align_head" in variables["params"] and "align_head" not in without.init(jax.random.PRNGKey(0), batch)["params"]
  )
  rngs = [jax.random.PRNGKey(i) for i in range(6)]
  metrics_with = jax.jit(lambda v, r: method.loss(v, batch, r)[1])  # (jitted: op by op it takes a minute)
  metrics_without = jax.jit(lambda v, r: without.loss(v, batch, r)[1])
  with_align = [metrics_with(variables, r) for r in rngs]
  no_align = [metrics_without(variables, r) for r in rngs]
  # The same token masks (alignment's coin is folded in), scored on the aligned pairs only: fewer masked tokens.
  masked = [float(m["masked_tokens"]) for m in with_align], [float(m["masked_tokens"]) for m in no_align]
  assert all(a <= n for a, n in zip(*masked, strict=True)) and 0 < sum(masked[0]) < sum(masked[1]), masked

  # The alignment loss reaches the head and, through the product of the pooled streams, both poolers.
  grads = jax.jit(jax.grad(lambda p: method.loss({**variables, "params": p}, batch, rngs[0])[0]))(variables["params"])
  for name in ("align_head", "t_pooler", "v_pooler"):
    assert float(jnp.abs(grads[name]["kernel"]).max()) > 0, name
  assert all(0 <= float(m["alignment_accuracy"]) <= 1 and np.isfinite(float(m["alignment_loss"])) for m in with_align)


# ---------------------------------------------------------------------------------------------------------
# End to end: pretrain (MMM) -> fine-tune with the base frozen -> weight distances.
# ---------------------------------------------------------------------------------------------------------
def test_vilbert_pretrain_then_frozen_vqa_end_to_end(tmp_path):
  pre = tmp_path / "vilbert_questions"
  # With the alignment objective: its head is the pretraining run's own, never loaded downstream (which would be
  # an error: "Pretrained values for params/align_head, which this model does not have").
  proc = run_main(
    pre,
    "--config.method.alignment_weight=1.0",
    config="tests/tiny_vlbert.py:arch=vilbert,stage=pretrain,data=questions",
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "alignment_accuracy" in proc.stderr
  summary = json.loads((pre / "summary.json").read_text())
  assert summary["steps"] == 4 and np.isfinite(summary["train/loss"])
  assert 0 <= summary["mlm/mlm_accuracy"] <= 100 and summary["mlm/masked_tokens"] > 0
  assert "region_loss" in proc.stderr  # ViLBERT's masked-region term (MMM)

  ft = tmp_path / "vilbert_questions_vqa_frozen"
  proc = run_main(
    ft, f"--config.method.pretrained_run={pre}", config="tests/tiny_vlbert.py:arch=vilbert,stage=finetune,frozen"
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((ft / "summary.json").read_text())
  assert 0 <= summary["task/vqa"] <= 100 and summary["task/pairs"] > 8  # several questions per image
  from vlrep import runs

  start, end = runs.load_run(str(pre), "latest"), runs.load_run(str(ft), "latest")
  # The frozen base is bit-identical to the pretraining run's after training; the task head moved.
  for name in ("bert", "v_layer_0", "co_layer_0", "regions_embed"):
    for a, b in zip(jax.tree.leaves(start.params[name]), jax.tree.leaves(end.params[name]), strict=True):
      np.testing.assert_array_equal(a, b)
  visual = zip(jax.tree.leaves(start.model_state["visual"]), jax.tree.leaves(end.model_state["visual"]), strict=True)
  for a, b in visual:
    np.testing.assert_array_equal(a, b)
  d = weight_distance.layer_distances(start.params, end.params)
  assert set(d) == {"t0", "v0"} and all(v["l1"] == 0.0 and v["angular"] < 1e-6 for v in d.values())
  assert os.path.exists(ft / "summary.json")


# ---------------------------------------------------------------------------------------------------------
# Region features from files.
# ---------------------------------------------------------------------------------------------------------
def test_region_files_lookup_normalises_boxes_and_counts_missing_images(tmp_path):
  from vlrep.data import region_files

  feats = np.arange(12, dtype=np.float32).reshape(3, 4)
  region_files.write_regions(
    str(tmp_path / "7.npz"), feats, [[0, 0, 50, 100], [10, 20, 30, 40], [0, 0, 1, 1]], 100, 200, [4, 1, 2]
  )
  region_files.write_regions(str(tmp_path / "9.npz"), feats[:1], [[50, 100, 100, 200]], 100, 200)
  pp = registry.parse(f"region_features('{tmp_path}', 2)")
  out = pp.batch_fn({"image_id": np.array([7, 8, 9])})
  assert out["regions"].shape == (3, 2, 4)
  np.testing.assert_array_equal(out["regions"][0], feats[:2])  # the first 2 regions
  np.testing.assert_allclose(out["boxes"][0, 0], [0.0, 0.0, 0.5, 0.5])  # x1 y1 x2 y2 px -> ymin xmin ymax xmax
  np.testing.assert_allclose(out["boxes"][0, 1], [0.1, 0.1, 0.2, 0.3])
  np.testing.assert_array_equal(out["box_mask"], [[True, True], [False, False], [True, False]])
  np.testing.assert_array_equal(out["region_labels"], [[4, 1], [-1, -1], [-1, -1]])  # no labels in 9.npz
  np.testing.assert_array_equal(out["stat_no_features"], [False, True, False])  # image 8 has no file


def test_convert_mmf_dumps_and_refuse_code_in_their_pickles(tmp_path):
  from vlrep.data import region_files

  src, dst = tmp_path / "mmf", tmp_path / "out"
  src.mkdir()
  cls_prob = np.eye(3, 5, dtype=np.float32)
  info = {
    "bbox": np.array([[0, 0, 10, 10], [5, 5, 20, 20], [1, 1, 2, 2]], np.float32),
    "num_boxes": 2,
    "image_width": 20,
    "image_height": 40,
    "cls_prob": cls_prob,
  }
  np.save(src / "42.npy", np.ones((3, 8), np.float32))
  np.save(src / "42_info.npy", info, allow_pickle=True)
  np.save(src / "43.npy", np.ones((3, 8), np.float32))  # no info file

  # An info file without boxes: a counted skip.
  np.save(src / "44.npy", np.ones((1, 8), np.float32))
  np.save(src / "44_info.npy", {"num_boxes": 1, "image_width": 20, "image_height": 40}, allow_pickle=True)
  counts = region_files.convert_mmf(str(src), str(dst))
  assert counts == {"converted": 1, "skipped_no_info": 1, "skipped_bad": 1}
  with np.load(dst / "42.npz") as z:
    assert z["features"].shape == (2, 8) and z["boxes"].shape == (2, 4)  # num_boxes = 2
    np.testing.assert_array_equal(z["labels"], [0, 1])  # argmax of cls_prob
    assert float(z["image_height"]) == 40

  # One whose pickle would run code stops the conversion, naming the file and the global; nothing runs (every kind
  # of payload: tests/test_safe_loading.py).
  class Evil:
    def __reduce__(self):
      return (os.system, ("touch " + str(tmp_path / "pwned"),))

  np.save(src / "45.npy", np.ones((1, 8), np.float32))
  np.save(src / "45_info.npy", np.array(Evil(), dtype=object), allow_pickle=True)
  with pytest.raises(ValueError, match=r"45_info\.npy asks for posix\.system"):
    region_files.convert_mmf(str(src), str(dst))
  assert not (tmp_path / "pwned").exists()


def test_visual_bert_entailment_from_region_files_end_to_end(tmp_path):
  from vlrep.data import region_files

  regions = tmp_path / "regions"
  regions.mkdir()
  rng = np.random.default_rng(0)
  for image_id in range(60):  # the tiny splits' ids are 0..63 (train) and 0..15 (val): 60..63 have no file
    region_files.write_regions(str(regions / f"{image_id}.npz"), rng.normal(size=(3, 16)), [[0, 0, 16, 16]] * 3, 32, 32)
  workdir = tmp_path / "vb_ve"
  proc = run_main(
    workdir,
    "--config.method.visual.dim=16",
    config=f"tests/tiny_vlbert.py:arch=visual_bert,stage=finetune,task=ve,regions={regions}",
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert 0 <= summary["task/accuracy"] <= 100 and summary["task/pairs"] == 8 * 4  # 8 images x 4 statements
  assert "no_features_count" in proc.stderr  # images without a region file are counted, not fatal


def _config_module():
  spec = importlib.util.spec_from_file_location("vlbert_config", os.path.join(ROOT, "configs", "vlbert.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_recipe_visual_bert_embeds_regions_as_visual_bert_and_mmf_do():
  # VisualBERT's and MMF's BertVisioLinguisticEmbeddings (the study's code): no box embedding, BERT's one embedding
  # LayerNorm over text and regions, visual token-type and position tables, the regions' token type MMF's 0.
  cfg = _config_module()
  want = dict(region_boxes=False, region_norm="shared", region_type_embedding="tables", region_type_id=0)
  for arg in ("", "runlocal", "stage=finetune,task=vqa", "runlocal,stage=finetune,task=vqa,frozen"):
    method = cfg.get_config(arg).method
    assert {k: method[k] for k in want} == want, arg
  c = cfg.get_config("runlocal")
  model = vl_bert.VLBertModel(
    arch="visual_bert",
    bert=bert_lib.BertConfig(
      vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    ),
    region_dim=6,
    **{k: c.method[k] for k in want},
  )
  tokens, types = jnp.ones((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32)
  regions, boxes = jnp.ones((1, 2, 6)), jnp.zeros((1, 2, 4))
  params = model.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, jnp.ones((1, 2), bool))["params"]
  assert set(params["regions_embed"]) == {"feature", "token_type_embeddings", "position_embeddings"}


def test_config_tasks_and_pretraining_fractions():
  import importlib.util

  spec = importlib.util.spec_from_file_location("vlbert_config", os.path.join(ROOT, "configs", "vlbert.py"))
  cfg = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg)
  assert cfg.get_config("fraction=10").data.split == "train[:10%]"
  assert cfg.get_config("runlocal,fraction=50").data.split == "train[:3.125%]"  # half of the 500-image clip
  # Texts per image per training step: runlocal fine-tunes on all of an image's questions (statements), pretrains on
  # one caption; pairs=N sets it in either stage.
  assert "|vl_pairs('qa', 5)|" in cfg.get_config("runlocal,stage=finetune,task=vqa,frozen").data.pp
  assert "|vl_pairs('entailment', 4)|" in cfg.get_config("runlocal,stage=finetune,task=ve").data.pp
  assert "|vl_pairs('captions', 1)|" in cfg.get_config("runlocal").data.pp
  assert "|vl_pairs('qa', 3)|" in cfg.get_config("stage=finetune,task=vqa,pairs=3").data.pp
  assert "vl_pairs('qa', 2, answer_as_text_b=True)" in cfg.get_config("runlocal,data=questions,pairs=2").data.pp
  with pytest.raises(FileNotFoundError, match="No run directory /runs/virtex"):  # read for its architecture
    cfg.get_config("runlocal,extractor=/runs/virtex")
  with pytest.raises(ValueError, match="exclude each other"):
    cfg.get_config("extractor=/runs/virtex,regions=/regions")
  assert cfg.get_config("data=ood_captions,fraction=1.2").data.name == "conceptual_captions"
  mm = cfg.get_config("stage=finetune,task=mmimdb")
  assert (mm.data.name, mm.method.loss, mm.method.num_labels, mm.best_metric) == ("mm_imdb", "bce", 23, "task/micro_f1")
  assert cfg.get_config("stage=finetune,task=vizwiz").evals.task.metric == "vqa"
  # Dropout: MMF's 0.1 in the recipe, none in runlocal (at 200 steps it lowers fine-tuned VQA).
  assert cfg.get_config("stage=finetune,task=vqa").method.bert_dropout == 0.1
  assert cfg.get_config("runlocal,stage=finetune,task=vqa").method.bert_dropout == 0.0
  # lr=X: what trains, at X (the head alone when frozen), in the recipe and runlocal alike.
  assert cfg.get_config("stage=finetune,task=vqa,frozen").optim.lr_groups == (("^task_head", 5e-5), (".*", 0.0))
  assert cfg.get_config("stage=finetune,task=vqa,frozen,lr=0.01").optim.lr_groups == (("^task_head", 0.01), (".*", 0.0))
  assert cfg.get_config("runlocal,stage=finetune,task=vqa,frozen,lr=0.01").optim.lr_groups[0] == ("^task_head", 0.01)
  assert cfg.get_config("runlocal,lr=3e-4").optim.lr_groups == ((".*", 3e-4),)
  with pytest.raises(ValueError, match="must be > 0"):
    cfg.get_config("stage=finetune,task=vqa,lr=-0.01")
  for arch, head_lr in (("visual_bert", 1e-3), ("vilbert", 1e-2)):  # runlocal's, chosen on probe_val
    assert cfg.get_config(f"runlocal,arch={arch},stage=finetune,task=vqa,frozen").optim.lr_groups[0][1] == head_lr
  with pytest.raises(ValueError, match="stage=pretrain"):
    cfg.get_config("stage=finetune,fraction=10")
  with pytest.raises(ValueError, match="analogues"):
    cfg.get_config("runlocal,stage=finetune,task=mmimdb")


def test_recipe_budgets_are_the_studys():
  """Section 2.5: AdamW, LR 5e-5, 2000 warmup steps, cosine, batch 1024, 88K updates "unless otherwise specified",
  evaluation every 6000 updates with the best validation score kept, betas (0.9, 0.999): no fine-tuning task is
  given another budget. Table A.1 specifies pretraining: batch 896 (1024 for ViLBERT on VQA-P and CC), 88K
  updates, betas (0.9, 0.98), no gradient clipping. runlocal keeps the settings of docs/results/vlbert.md's
  runlocal figures."""
  for arch in ("visual_bert", "vilbert"):
    for task in ("vqa", "vizwiz", "ve", "mmimdb"):
      for frozen in ("", ",frozen"):
        c = _recipe(f"arch={arch},stage=finetune,task={task}{frozen}")
        assert (c.batch_size, c.total_steps, c.evals.task.every_steps) == (1024, 88_000, 6000), (arch, task)
        optim = (c.optim.name, c.optim.warmup_steps, c.optim.b1, c.optim.b2, c.optim.eps)
        assert optim == ("adamw", 2000, 0.9, 0.999, 1e-8)
        assert c.optim.lr_groups[0][1] == 5e-5 and c.best_metric.startswith("task/")
    table_a1 = {"captions": 896, "questions": 1024 if arch == "vilbert" else 896,
                "ood_captions": 1024 if arch == "vilbert" else 896}  # fmt: skip
    for data, batch in table_a1.items():
      c = _recipe(f"arch={arch},stage=pretrain,data={data}")
      assert (c.batch_size, c.total_steps, c.optim.warmup_steps) == (batch, 88_000, 2000), (arch, data)
      assert (c.optim.b1, c.optim.b2, c.optim.eps, c.optim.grad_clip_norm) == (0.9, 0.98, 1e-8, 0.0)
      assert c.optim.lr_groups == ((".*", 5e-5),)
  # runlocal: its own budget and the optimizer settings of docs/results/vlbert.md's runlocal figures.
  for arg in ("runlocal", "runlocal,stage=finetune,task=vqa", "runlocal,arch=vilbert,stage=finetune,task=ve,frozen"):
    c = _recipe(arg)
    assert (c.batch_size, c.total_steps, c.optim.b2, c.optim.grad_clip_norm) == (64, 200, 0.999, 1.0), arg
  assert _recipe("runlocal,stage=finetune,task=vqa").evals.task.every_steps == 100


def _recipe(arg):
  import importlib.util

  spec = importlib.util.spec_from_file_location("vlbert_config", os.path.join(ROOT, "configs", "vlbert.py"))
  cfg = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg)
  return cfg.get_config(arg)


def _recipe_batch(c, rng, b=2, classes=0):
  """A batch at the recipe's shapes, read from its preprocessing: image size, regions per image, text length."""
  resize = registry.op_arguments(c.data.pp, "resize_small")
  size = resize["size"] if resize else 0
  n = registry.op_arguments(c.data.pp, "regions_from_objects", "region_features")["max_regions"]
  t = registry.op_arguments(c.data.pp, "tokenize_pairs")["max_len"]
  tokens = np.zeros((b, 1, t), np.int32)
  tokens[:, 0, :24] = [101, *rng.integers(1996, 3000, 22), 102]  # enough words that some are masked
  batch = {
    "boxes": np.tile(np.array([0.1, 0.2, 0.5, 0.7], np.float32), (b, n, 1)),
    "box_mask": np.arange(n)[None].repeat(b, 0) < 20,
    "region_labels": rng.integers(0, 80, (b, n)).astype(np.int32),
    "tokens": tokens,
    "type_ids": np.zeros_like(tokens),
    "pair_mask": np.ones((b, 1), bool),
  }
  if size:
    batch["image"] = rng.normal(size=(b, size, size, 3)).astype(np.float32)
  else:
    batch["regions"] = rng.normal(size=(b, n, int(c.method.visual.dim))).astype(np.float32)
  if classes:
    batch["region_probs"] = rng.dirichlet(np.ones(classes), (b, n)).astype(np.float32)
  return batch


def test_recipe_shapes_come_from_the_config_not_from_the_region_directory(tmp_path):
  """regions=DIR puts a user path into data.pp; the recipe's 36 regions per image must not be read out of it."""
  for directory in (tmp_path / "pytest-0" / "feats", tmp_path / "x|y'7"):
    c = _recipe(f"arch=visual_bert,stage=pretrain,bert=minilm,regions={directory}")
    batch = _recipe_batch(c, np.random.default_rng(0))
    assert batch["regions"].shape[1] == batch["boxes"].shape[1] == 36
    assert batch["tokens"].shape[-1] == 36
    assert registry.op_arguments(c.data.pp, "region_features")["directory"] == str(directory)


@pytest.mark.parametrize(
  "arch, regions, extra",
  [
    ("vilbert", "", {"visual.mode": "grid", "region_target": "feature"}),
    ("vilbert", "", {}),  # the recipe's default: RoIAlign over the dataset's 36 object boxes, their classes
    ("vilbert", "files", {}),  # the study's detector features, KL to their cls_prob
    ("visual_bert", "", {"visual.mode": "grid"}),
    ("visual_bert", "files", {}),
  ],
)
def test_recipe_configs_take_one_step_at_their_real_shapes(arch, regions, extra, tmp_path):
  arg = f"arch={arch},stage=pretrain,bert=minilm" + (f",regions={tmp_path}" if regions else "")
  c = _recipe(arg)
  # Small widths (MiniLM's first 2 layers, a thin ResNet-50, a narrow visual stream); the data shapes are the
  # recipe's.
  c.method.update(bert_layers=2, v_layers=2, v_hidden=64, v_heads=2, v_intermediate=64, bi_hidden=64, bi_heads=2)
  c.method.dtype = "float32"
  c.method.visual.backbone.update(depth=26, width=8)  # stride 32 as ResNet-50's: the same 7x7 grid at 224 px
  c.method.visual.allow_random_init = True  # a trained extractor's weights are not read by init
  for key, value in extra.items():
    holder, _, leaf = key.rpartition(".")
    (c.method.visual if holder == "visual" else c.method)[leaf] = value
  c.method.region_classes = 1601
  method = vlbert.Method(c.method, 30522)
  if regions:
    assert method.fields[0] == "regions" and c.method.visual.dim == 2048
  classes = 1601 if "region_probs" in method.fields else 0
  assert (classes > 0) == (arch == "vilbert" and regions == "files")
  batch = {k: jnp.asarray(v) for k, v in _recipe_batch(c, np.random.default_rng(0), classes=classes).items()}
  variables = method.init(jax.random.PRNGKey(0), batch)
  if "visual" in variables and extra.get("visual.mode") == "grid":
    feats, _, mask = method.regions.apply(variables["visual"], batch["image"], batch["boxes"], batch["box_mask"])
    assert feats.shape[1] == mask.shape[1] == 49  # the 7x7 grid at 224 px, not the 36 boxes
  loss_fn = lambda p: method.loss({**variables, "params": p}, batch, jax.random.PRNGKey(1))[:2]
  step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (loss, metrics), grads = step(variables["params"])
  assert np.isfinite(float(loss)) and float(metrics["mlm_loss"]) > 0
  if arch == "vilbert":
    assert float(metrics["masked_regions"]) > 0 and float(metrics["region_loss"]) > 0
    assert float(jnp.abs(grads["region_head_2"]["kernel"]).max()) > 0
  assert float(jnp.abs(grads["regions_embed"]["feature"]["kernel"]).max()) > 0


def test_extractor_run_supplies_the_regions_resnet_and_runs_need_no_other_run_until_they_start(monkeypatch):
  """extractor=RUN (e.g. a VirTex run): its ResNet, architecture (copied into visual.backbone, so the VL run saves
  what it builds) and weights, extracts the regions. Building the method reads no other run, so evaluating or
  resuming a VL run works without its extractor or pretraining run; a start whose visual.backbone differs from
  the ResNet the weights come from is an error."""
  from vlrep import runs, train_state
  from vlrep.models import resnet

  backbone = dict(depth=10, width=8, stem="small", stem_stride=2)
  net = resnet.ResNet(**backbone, bn_group_size=0)
  net_vars = net.init(jax.random.PRNGKey(3), jnp.zeros((1, 32, 32, 3)), train=False)
  # Batch statistics a fresh init would not have: the extractor must use these, not its own.
  stats = jax.tree.map(lambda a: a + 0.5, net_vars["batch_stats"])
  virtex = runs.Run(
    config=ConfigDict({"method": {"name": "virtex", "backbone": {**backbone, "bn_group_size": 32}}}),
    params={"backbone": net_vars["params"], "head": {"w": np.zeros(3)}},
    model_state={"batch_stats": {"backbone": stats}},
    step=5,
    path="/runs/virtex/best/5",
    meta={},
  )
  vl_only = runs.Run(ConfigDict({"method": {"name": "vlbert"}}), {}, {}, 1, "/runs/vl_only/best/1", {})
  available = {"/runs/virtex": virtex, "/runs/vl_only": vl_only}
  monkeypatch.setattr(runs, "read_config", lambda path: available[path].config)
  monkeypatch.setattr(runs, "load_run", lambda path, checkpoint="best": available[path])
  with pytest.raises(ValueError, match="no ResNet backbone"):
    _recipe("arch=visual_bert,stage=pretrain,bert=minilm,extractor=/runs/vl_only")

  c = _recipe("arch=visual_bert,stage=pretrain,bert=minilm,extractor=/runs/virtex")
  c.method.update(bert_layers=1, dtype="float32")
  assert c.method.visual.init_from == "/runs/virtex"
  assert dict(c.method.visual.backbone) == {**backbone, "inner_multiplier": 1, "bn_group_size": 0}
  method = vlbert.Method(c.method, 30522)
  assert method.regions_dim() == net.num_features
  batch = {k: jnp.asarray(v) for k, v in _recipe_batch(c, np.random.default_rng(0)).items()}
  variables = method.init(jax.random.PRNGKey(0), batch)
  visual = train_state.pretrained_variables_of(method)["model_state"]["visual"]
  assert jax.tree.map(jnp.shape, visual) == jax.tree.map(jnp.shape, dict(variables["visual"]))
  feats, _, _ = method.regions.apply(visual, batch["image"], batch["boxes"], batch["box_mask"])
  grid, _ = net.apply({"params": net_vars["params"], "batch_stats": stats}, batch["image"], train=False)
  expected = vl_bert.roi_sample(grid.astype(jnp.float32), batch["boxes"], 7).mean(axis=(2, 3))
  np.testing.assert_allclose(feats, expected, rtol=1e-5, atol=1e-5)

  # init_from set alone leaves the recipe's ResNet-50 in visual.backbone: refused when the weights load.
  wrong = _recipe("arch=visual_bert,stage=pretrain,bert=minilm")
  wrong.method.update(bert_layers=1, dtype="float32")
  wrong.method.visual.init_from = "/runs/virtex"
  with pytest.raises(ValueError, match="depth': 10.*builds.*depth': 50.*extractor=RUN"):
    train_state.pretrained_variables_of(vlbert.Method(wrong.method, 30522))

  # Downstream of a VL run pretrained with that extractor: its extractor weights, the same ResNet.
  available["/runs/vl"] = runs.Run(
    config=ConfigDict({"method": c.method.to_dict()}),
    params={},
    model_state={"visual": visual},
    step=7,
    path="/runs/vl/best/7",
    meta={},
  )
  down = _recipe("arch=visual_bert,stage=finetune,task=vqa,bert=minilm,extractor=/runs/virtex")
  down.method.update(bert_layers=1, dtype="float32", num_labels=3, pretrained_run="/runs/vl")
  got = train_state.pretrained_variables_of(vlbert.Method(down.method, 30522))["model_state"]["visual"]
  assert jax.tree.map(np.shape, got) == jax.tree.map(np.shape, visual)
  down_default = _recipe("arch=visual_bert,stage=finetune,task=vqa,bert=minilm")
  down_default.method.update(bert_layers=1, dtype="float32", num_labels=3, pretrained_run="/runs/vl")
  with pytest.raises(ValueError, match="/runs/vl/best/7's region extractor is a ResNet"):
    train_state.pretrained_variables_of(vlbert.Method(down_default.method, 30522))

  # Every run gone: the methods of all these runs still build (as vlrep.evaluate and a resume build them).
  available.clear()
  for config in (c, down, wrong):
    assert vlbert.Method(config.method, 30522).regions_dim() > 0


def test_recipe_refuses_regions_that_would_train_silently_wrong(tmp_path):
  c = _recipe("arch=vilbert,stage=pretrain,bert=minilm")
  with pytest.raises(ValueError, match="randomly initialised"):
    vlbert.Method(c.method, 30522)
  c.method.visual.init_from = "/some/run"
  c.method.visual.mode = "grid"
  with pytest.raises(ValueError, match="grid.*region_target='feature'"):
    vlbert.Method(c.method, 30522)
  c.method.visual.mode, c.method.region_target = "roi_align", "distribution"
  with pytest.raises(ValueError, match="region files"):
    vlbert.Method(c.method, 30522)
  # Region files without the detector's distribution cannot feed ViLBERT's KL target: the op names the file.
  from vlrep.data import region_files

  region_files.write_regions(str(tmp_path / "3.npz"), np.ones((2, 4)), [[0, 0, 4, 4]] * 2, 8, 8, [1, 2])
  with pytest.raises(ValueError, match="3.npz has no cls_prob"):
    registry.parse(f"region_features('{tmp_path}', 4, class_probs=True)")
  region_files.write_regions(str(tmp_path / "3.npz"), np.ones((2, 4)), [[0, 0, 4, 4]] * 2, 8, 8, [1, 2], np.eye(2, 5))
  out = registry.parse(f"region_features('{tmp_path}', 4, class_probs=True)").batch_fn({"image_id": np.array([3, 5])})
  np.testing.assert_array_equal(out["region_probs"][0, :2], np.eye(2, 5))
  assert out["region_probs"].shape == (2, 4, 5) and not out["region_probs"][1].any()  # image 5: no file
  # runlocal's random frozen crops are its deliberate, documented choice.
  assert _recipe("runlocal,arch=vilbert").method.visual.allow_random_init


def test_study_grid_seeds_and_tables_average_the_seeds(tmp_path, monkeypatch):
  from vlrep.tools import vl_study

  runs = vl_study.grid(["vilbert"], ["none", "captions"], ["vqa"], seeds=(0, 3))
  names = [r[0] for r in runs]
  # One pretraining run per source, before the downstream runs that load it; seed 0 keeps the plain name.
  assert names[0] == "vilbert_captions"
  assert "vilbert_captions_vqa_frozen" in names and "vilbert_captions_vqa_frozen_s3" in names
  by_name = {r[0]: r for r in runs}
  assert by_name["vilbert_captions_vqa_frozen_s3"][1:] == (
    "arch=vilbert,stage=finetune,task=vqa,frozen",
    "vilbert_captions",
    ["seed=3"],
  )
  assert by_name["vilbert_none_vqa_finetune"][2:] == ("", [])
  assert len(names) == 1 + 2 * 2 * 2

  scores = {"vilbert_none_vqa_frozen": 50.0, "vilbert_none_vqa_frozen_s3": 56.0, "vilbert_captions_vqa_frozen": 40.0}
  for name, score in scores.items():
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / "summary.json", "w") as f:
      json.dump({"task/vqa_best": score, "preempted": False}, f)
  assert vl_study.cell(str(tmp_path), "vilbert", "none", "vqa", "frozen", (0, 3)) == [50.0, 56.0]
  # A seed not run yet is shown as missing and left out of the mean.
  assert vl_study.cell(str(tmp_path), "vilbert", "captions", "vqa", "frozen", (0, 3)) == [40.0, None]
  md = vl_study.tables(str(tmp_path), ["vilbert"], ["none", "captions"], ["vqa"], seeds=(0, 3))
  assert "| vilbert | none | 53.00 ± 4.24 (50.00 / 56.00) |" in md
  assert "| vilbert | captions | 40.00 ± 0.00 (40.00 / —) |" in md
  single = vl_study.tables(str(tmp_path), ["vilbert"], ["none"], ["vqa"])
  assert "| vilbert | none | 50.00 |" in single
  with pytest.raises(ValueError, match="must be integers"):
    vl_study.study("configs/vlbert.py:runlocal", str(tmp_path), ["vilbert"], ["none"], ["vqa"], seeds=["a"])
  with pytest.raises(ValueError, match="distinct seeds"):
    vl_study.study("configs/vlbert.py:runlocal", str(tmp_path), ["vilbert"], ["none"], ["vqa"], seeds=(1, 1))
  frozen_only = vl_study.grid(["vilbert"], ["none"], ["vqa"], modes=("frozen",))
  assert [r[0] for r in frozen_only] == ["vilbert_none_vqa_frozen"]
  assert "fine-tuned" not in vl_study.tables(str(tmp_path), ["vilbert"], ["none"], ["vqa"], modes=("frozen",))
  with pytest.raises(ValueError, match="--modes"):
    vl_study.study("configs/vlbert.py:runlocal", str(tmp_path), ["vilbert"], ["none"], ["vqa"], modes=("linear",))
  # Which runs study() starts, and with which overrides: downstream ones alone get downstream_overrides.
  calls = []
  record = lambda cfg, wd, extra, ev, dry_run=False: calls.append((os.path.basename(wd), extra))
  monkeypatch.setattr(vl_study.sweep, "run_variant", record)
  vl_study.study(
    "configs/vlbert.py:runlocal",
    str(tmp_path / "new"),
    ["vilbert"],
    ["none", "captions"],
    ["vqa"],
    overrides=["log_every_steps=7"],
    seeds=(0, 1),
    modes=("frozen",),
    downstream_overrides=["total_steps=600"],
  )
  pre = "method.pretrained_run=" + str(tmp_path / "new" / "vilbert_captions")
  assert calls == [
    ("vilbert_captions", ["log_every_steps=7"]),
    ("vilbert_none_vqa_frozen", ["log_every_steps=7", "total_steps=600"]),
    ("vilbert_none_vqa_frozen_s1", ["log_every_steps=7", "seed=1", "total_steps=600"]),
    ("vilbert_captions_vqa_frozen", ["log_every_steps=7", "total_steps=600", pre]),
    ("vilbert_captions_vqa_frozen_s1", ["log_every_steps=7", "seed=1", "total_steps=600", pre]),
  ]
