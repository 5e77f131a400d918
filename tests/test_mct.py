"""MCT: queues under sharding, the momentum update, the five losses against numpy, loss subsets for missing
captions/tags, retrieval metrics, and an end-to-end run whose resume restores the queues."""

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, run_main, run_module

from vlrep.data import ops, registry  # noqa: F401  (ops registers the paraphrase ops)
from vlrep.evaluators import retrieval
from vlrep.methods import mct


def _tiny_method_and_batch(batch_size=8, seed=0):
  import tiny_mct

  from vlrep import methods

  config = tiny_mct.get_config()
  method = methods.build(config.method, 50)
  rng = np.random.default_rng(seed)
  batch = {
    "image_q": rng.normal(size=(batch_size, 32, 32, 3)).astype(np.float32),
    "image_k": rng.normal(size=(batch_size, 32, 32, 3)).astype(np.float32),
    "tokens_q": rng.integers(5, 50, (batch_size, 12)).astype(np.int32),
    "tokens_k": rng.integers(5, 50, (batch_size, 12)).astype(np.int32),
    "tags": (rng.random((batch_size, 20)) < 0.3).astype(np.uint8),
    "stat_empty": np.zeros((batch_size,), bool),
  }
  return config, method, batch


# ---------------------------------------------------------------------------------------------------------
# Losses against numpy.
# ---------------------------------------------------------------------------------------------------------
def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_recipe_defaults_are_the_papers_method_and_runlocal_keeps_its_own():
  """MCT's method: a pretrained BERT-base text tower and lambda_tag = 0 ('with tag' and 'scratch' are variants);
  runlocal trains the small text tower from scratch with tags, the setting docs/results/mct.md reports."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import mct as mct_config

  recipe = mct_config.get_config()
  assert recipe.method.text_tower == "bert" and recipe.method.weights.j_tag == 0.0
  assert recipe.tokenizer.kind == "wordpiece" and recipe.method.bert_path == ""  # bert=PATH is required
  assert mct_config.get_config("tags=True").method.weights.j_tag == 1.0
  assert mct_config.get_config("text=scratch").method.text_tower == "scratch"
  local = mct_config.get_config("runlocal")
  assert local.method.text_tower == "scratch" and local.method.weights.j_tag == 1.0
  with pytest.raises(ValueError, match="expected True or False"):
    mct_config.get_config("tags=maybe")


def test_recipe_lr_groups_text_body_at_berts_rate_heads_at_the_image_rate_runlocal_unchanged():
  """The paper gives 0.03 (image encoder) and 4e-5 (text encoder), not the text heads' rate: the recipe trains the
  pretrained BERT body at 4e-5 and the fresh text heads with the image heads at 0.03; runlocal keeps the groups of
  docs/results/mct.md (whole text tower 0.05, the rest 0.1)."""
  from vlrep import optim

  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import mct as mct_config

  leaf = {"kernel": 0}
  params = {name: {"fc1": leaf} for name in ("backbone", "image_intra", "image_inter", "text_pooler", "text_intra",
                                              "text_inter")}  # fmt: skip
  params["textual"] = {"encoder": {"layer_0": {"attention": leaf}}}

  def rates(config):  # each top-level module's (single) parameter's peak LR
    labels, peaks = optim.group_labels(params, config.optim.lr_groups)
    return {name: peaks[jax.tree.leaves(labels[name])[0]] for name in params}

  recipe = rates(mct_config.get_config())
  assert recipe.pop("textual") == 4e-5 and set(recipe.values()) == {0.03}, recipe
  local = rates(mct_config.get_config("runlocal"))
  assert {k: local[k] for k in ("textual", "text_pooler", "text_intra", "text_inter")} == dict.fromkeys(
    ("textual", "text_pooler", "text_intra", "text_inter"), 0.05
  )
  assert {k: local[k] for k in ("backbone", "image_intra", "image_inter")} == dict.fromkeys(
    ("backbone", "image_intra", "image_inter"), 0.1
  )


def test_paraphrases_replace_every_view_by_default_as_back_translation_does():
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import mct as mct_config

  pp = mct_config.get_config("paraphrases=/bt/coco.json").data.pp
  assert "|caption_views(0.1, 0.1)|paraphrase_draws|" in pp and "|paraphrases('/bt/coco.json', 1)|tokenize(" in pp
  half = mct_config.get_config("paraphrases=/bt/coco.json,paraphrase_prob=0.5").data.pp
  assert "|paraphrases('/bt/coco.json', 0.5)|" in half
  assert "paraphrase" not in mct_config.get_config().data.pp
  with pytest.raises(ValueError, match="paraphrase_prob"):
    mct_config.get_config("paraphrases=/bt/coco.json,paraphrase_prob=2")


def test_losses_match_numpy():
  rng = np.random.default_rng(0)
  b, k, d, tau, alpha = 3, 7, 5, 0.07, 0.2
  q, kp, queue = _unit(rng.normal(size=(b, d))), _unit(rng.normal(size=(b, d))), _unit(rng.normal(size=(k, d)))
  valid = np.array([1, 1, 0, 1, 1, 1, 0], bool)
  extra = rng.random((b, k)) < 0.4
  nce, _ = mct.info_nce(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(queue), jnp.asarray(valid), tau)
  tag, count = mct.info_nce(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(queue), jnp.asarray(valid), tau, extra)
  rank = mct.margin_ranking(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(queue), jnp.asarray(valid), alpha)
  for i in range(b):
    pos = q[i] @ kp[i]
    negs = [q[i] @ queue[j] for j in range(k) if valid[j]]
    denom = np.exp(pos / tau) + sum(np.exp(s / tau) for s in negs)
    np.testing.assert_allclose(nce[i], -np.log(np.exp(pos / tau) / denom), rtol=1e-5)
    # Eq. 5: the positives are k+ and the valid queue entries marked as sharing tags.
    positives = [pos] + [q[i] @ queue[j] for j in range(k) if valid[j] and extra[i, j]]
    want = -np.mean([np.log(np.exp(s / tau) / denom) for s in positives])
    np.testing.assert_allclose(tag[i], want, rtol=1e-5)
    assert count[i] == len(positives)
    # Eq. 11/14: hinge over the valid queue entries.
    want = sum(max(0.0, alpha - pos + q[i] @ queue[j]) for j in range(k) if valid[j])
    np.testing.assert_allclose(rank[i], want, rtol=1e-5)


def test_loss_subsets_for_missing_captions_and_tags_never_nan():
  config, method, batch = _tiny_method_and_batch()
  variables = jax.jit(method.init)(jax.random.PRNGKey(0), batch)
  loss_fn = jax.jit(method.loss, static_argnums=3)
  # Rows 0-1: caption and tags; 2-3: tags only; 4-5: caption only; 6-7: neither. Row 3's tags repeat one label
  # (a multi-hot vector counts it once).
  batch["stat_empty"] = np.array([0, 0, 1, 1, 0, 0, 1, 1], bool)
  batch["tags"][4:] = 0
  batch["tags"][3] = 0
  batch["tags"][3, 7] = 1
  loss, metrics, _ = loss_fn(variables, batch, jax.random.PRNGKey(1), True)
  assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
  w = config.method.weights
  want = sum(w[n] * metrics[n] for n in ("j_ii", "j_tag", "j_cc", "j_ic", "j_ci"))
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  # No image has a caption or tags: the loss is lambda_ii J_ii alone.
  batch["stat_empty"][:] = True
  batch["tags"][:] = 0
  loss, metrics, state = loss_fn(variables, batch, jax.random.PRNGKey(1), True)
  np.testing.assert_allclose(float(loss), w["j_ii"] * float(metrics["j_ii"]), rtol=1e-6)
  assert float(metrics["j_cc"]) == float(metrics["j_tag"]) == 0.0
  # Their captions enter the queue as invalid: never negatives later.
  assert not np.asarray(state["queues"]["text_valid"][:8]).any() and np.asarray(state["queues"]["text_valid"][8:]).all()


def test_momentum_update_is_exact():
  config, method, batch = _tiny_method_and_batch()
  variables = method.init(jax.random.PRNGKey(0), batch)
  # Make the key encoder differ from the query encoder first.
  variables["momentum"]["params"] = jax.tree.map(lambda x: x * 0.5 + 0.01, variables["momentum"]["params"])
  _, _, state = jax.jit(lambda v, b: method.loss(v, b, jax.random.PRNGKey(2), True))(variables, batch)
  m = np.float32(config.method.momentum)
  want = jax.tree.map(
    lambda k, q: m * np.asarray(k) + (np.float32(1) - m) * np.asarray(q),
    variables["momentum"]["params"],
    variables["params"],
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-8), state["momentum"]["params"], want
  )


# ---------------------------------------------------------------------------------------------------------
# Queues under sharding: 1 and 8 (fake) devices give a plain ring buffer.
# ---------------------------------------------------------------------------------------------------------
def test_queue_order_and_wraparound_on_1_and_8_devices():
  """tests/mct_queues.py on 1 and on 8 devices, each in a process of its own (a device count is set at start)."""
  results = []
  for n in (1, 8):
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}
    proc = run_module("mct_queues", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  one, eight = results
  assert one["devices"] == 1 and eight["devices"] == 8
  # On 8 devices each holds 32 / 8 keys of every queue.
  assert one["rows_per_device"] == [32] and eight["rows_per_device"] == [4] and "data" in eight["spec"]
  # The keys themselves agree across device counts (BatchNorm groups of 4 are device-count independent).
  np.testing.assert_allclose(np.array(one["image_intra"]), np.array(eight["image_intra"]), atol=2e-4)


def test_queue_size_must_be_a_multiple_of_the_batch():
  _, method, batch = _tiny_method_and_batch(batch_size=6)
  with pytest.raises(ValueError, match="multiple of the global batch size 6"):
    method.init(jax.random.PRNGKey(0), batch)


# ---------------------------------------------------------------------------------------------------------
# Retrieval metrics.
# ---------------------------------------------------------------------------------------------------------
def test_retrieval_metrics_by_hand():
  images = np.eye(3, dtype=np.float32)
  # Captions 0,1 of image 0; 2 of image 1; 3 of image 2 — caption 2 points at image 2, caption 3 at image 1.
  texts = np.array([[1, 0, 0], [0.9, 0.1, 0], [0, 0.2, 0.9], [0, 0.9, 0.2]], np.float32)
  owner = np.array([0, 0, 1, 2])
  m = retrieval.retrieval_metrics(images, texts, owner)
  # t2i ranks: 1, 1, 2, 2 -> R@1 50%; i2t: image 0 rank 1; image 1's caption 2 ranks 2nd; image 2's caption 3
  # ranks 2nd.
  assert m["t2i_r1"] == 50.0 and m["t2i_r5"] == 100.0 and m["t2i_medr"] == 1.5
  assert m["i2t_r1"] == pytest.approx(100 / 3) and m["i2t_medr"] == 2.0 and m["chance_r1"] == pytest.approx(100 / 3)
  folded = retrieval.folded_metrics(np.concatenate([images, images]), np.concatenate([texts, texts]),
                                    np.concatenate([owner, owner + 3]), 3)  # fmt: skip
  assert folded == pytest.approx(m)


# ---------------------------------------------------------------------------------------------------------
# End to end: main, summary, and a resume that restores the queues.
# ---------------------------------------------------------------------------------------------------------
def _restore(workdir, step):
  import orbax.checkpoint as ocp

  path = os.path.join(workdir, "checkpoints", str(step), "state")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(path).item_metadata
  return checkpointer.restore(
    path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  )


def test_main_end_to_end_and_resume_restores_queues(tmp_path, tiny_mct_run):
  """The session's tiny MCT run (tests/conftest.py's shared_run; also runlocal's documented command)."""
  proc, run = tiny_mct_run, tiny_mct_run.workdir
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((run / "summary.json").read_text())
  keys = ("probe/map", "retrieval/i2t_r1", "retrieval/t2i_r10", "retrieval/rsum", "retrieval/i2t_r1_random_init")
  keys += ("vsepp/i2t_r1", "vsepp/t2i_r10", "vsepp/train_pairs")
  for key in keys + ("tagging/miou3", "tagging/prior_miou10", "tagging/unseen_tags"):
    assert key in summary, sorted(summary)
  assert "retrieval/chance_r1" in summary and summary["steps"] == 6
  final = _restore(run, 6)
  queues = final["model_state"]["queues"]
  assert int(queues["ptr"]) == 6 * 8 % 32 and np.asarray(queues["tags"]).any()
  # Resume from step 3 (drop the step-6 checkpoint): the same final queues, momentum and parameters.
  shutil.copytree(run, tmp_path / "resumed", ignore=shutil.ignore_patterns("6", "best"))
  os.remove(tmp_path / "resumed" / "summary.json")
  again = run_main(tmp_path / "resumed", "--config.evals={}", config="tests/tiny_mct.py")
  assert again.returncode == 0 and "Resumed from step 3" in again.stderr, again.stderr[-3000:]
  resumed = _restore(tmp_path / "resumed", 6)
  jax.tree.map(np.testing.assert_array_equal, resumed["model_state"], final["model_state"])
  jax.tree.map(np.testing.assert_array_equal, resumed["params"], final["params"])


def test_shuffled_batchnorm_keys_come_back_in_order():
  """With BatchNorm over the whole batch (permutation-invariant) and key encoder = query encoder, the enqueued
  keys equal the encoder's output on the unshuffled key images: the permutation is undone exactly."""
  _, method, batch = _tiny_method_and_batch()
  method.model = method.model.clone(backbone={**method.model.backbone, "bn_group_size": 0})
  v = method.init(jax.random.PRNGKey(0), batch)
  v["momentum"] = {"params": v["params"], "batch_stats": v["batch_stats"]}
  _, _, state = method.loss(v, batch, jax.random.PRNGKey(3), True)
  (img, _), _ = method.model.apply(
    {"params": v["params"], "batch_stats": v["batch_stats"]}, batch["image_k"], batch["tokens_k"], True,
    rngs={"dropout": jax.random.PRNGKey(0)}, mutable=["batch_stats"],
  )  # fmt: skip
  want = np.asarray(mct.l2_normalize(img["intra"]))
  np.testing.assert_allclose(np.asarray(state["queues"]["image_intra"][:8]), want, atol=1e-5)
  # With groups of 4 the shuffle changes the key statistics (it is not a no-op).
  _, method4, _ = _tiny_method_and_batch()
  v4 = method4.init(jax.random.PRNGKey(0), batch)
  v4["momentum"] = {"params": v4["params"], "batch_stats": v4["batch_stats"]}
  a = method4.loss(v4, batch, jax.random.PRNGKey(3), True)[2]["queues"]["image_intra"][:8]
  b = method4.loss(v4, batch, jax.random.PRNGKey(4), True)[2]["queues"]["image_intra"][:8]
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4


def test_text_keys_need_no_shuffle_their_only_batchnorm_sees_the_whole_batch():
  """Shuffled BatchNorm matters where statistics come from groups of the batch (the image backbone's
  bn_group_size; test_shuffled_batchnorm_keys_come_back_in_order): the shuffle puts a key in another group than its
  query. The text path's only BatchNorm is in the heads (head_bn=inter|all; the encoders use LayerNorm), over the
  whole batch: permuting the key captions before it and back after gives the same keys and statistics in training
  mode, so shuffling them would change nothing but which caption draws which dropout mask. Should the heads ever
  get grouped BatchNorm, this fails: the text keys would then need the image path's shuffle."""
  from vlrep.models.mct import MCTModel

  text = dict(hidden=32, num_layers=1, num_heads=2, max_len=16, dropout=0.0)
  model = MCTModel(50, dict(depth=10, width=8, bn_group_size=4), text, head_hidden=32, intra_dim=8, inter_dim=16,
                   head_batchnorm=("intra", "inter"), text_pool="mean")  # fmt: skip
  tokens = np.random.default_rng(0).integers(5, 50, (8, 12)).astype(np.int32)
  variables = model.init(jax.random.key(0), tokens[:1], method=MCTModel.embed_texts)
  perm = np.array([3, 7, 0, 5, 1, 6, 2, 4])
  inverse = np.argsort(perm)
  apply = jax.jit(lambda t: model.apply(variables, t, True, method=MCTModel.embed_texts, mutable=["batch_stats"]))
  want, want_stats = apply(tokens)
  got, got_stats = apply(tokens[perm])
  assert set(want_stats["batch_stats"]) == {"text_intra", "text_inter"}  # BatchNorm in both text heads
  for k in ("intra", "inter"):
    np.testing.assert_allclose(np.asarray(got[k])[inverse], np.asarray(want[k]), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got[k]) - np.asarray(want[k])).max() > 1e-3  # the permutation was applied
  for a, b in zip(jax.tree.leaves(got_stats), jax.tree.leaves(want_stats), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_text_pooling_mean_ignores_padding_and_separates_captions_cls_does_not():
  """'mean' averages the non-padding tokens (more padding changes nothing); at init 'cls' gives nearly the
  same embedding for unrelated captions (the runlocal collapse), 'mean' clearly different ones."""
  from vlrep.models.mct import MCTModel

  text = dict(hidden=32, num_layers=2, num_heads=2, max_len=24, dropout=0.0)
  rng = np.random.default_rng(0)
  a, b = rng.integers(5, 50, 10), rng.integers(5, 50, 10)
  tokens = np.zeros((3, 24), np.int32)
  tokens[0, :10], tokens[1, :10], tokens[2, :7] = a, b, a[:7]
  tokens[:, 0] = 2  # every caption starts with [SOS], as the tokenizer writes them
  cos = {}
  for pool in ("cls", "mean"):
    model = MCTModel(50, dict(depth=10, width=8), text, head_hidden=32, intra_dim=8, inter_dim=16, text_pool=pool)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), tokens)
    emb = np.asarray(model.apply(variables, tokens, method=MCTModel.embed_texts)["inter"])
    # The same caption with 14 padding tokens or 22 (a shorter max_len) embeds identically.
    short = np.asarray(model.apply(variables, tokens[:1, :10], method=MCTModel.embed_texts)["inter"])
    np.testing.assert_allclose(short[0], emb[0], rtol=1e-4, atol=1e-5)
    cos[pool] = float(_unit(emb[0]) @ _unit(emb[1]))
    assert float(_unit(emb[0]) @ _unit(emb[2])) < 1 - 1e-6  # a truncated caption is a different caption
  assert cos["cls"] > 0.99 and cos["mean"] < cos["cls"] - 0.01, cos


def test_paraphrase_file_replaces_caption_views_by_the_draws_and_counts_missing(tmp_path):
  import tensorflow as tf

  path = tmp_path / "para.json"
  path.write_text(json.dumps({"a red cube.": ["one red cube.", "a cube that is red."], "x": []}))
  pp = registry.parse(f"paraphrase_draws|paraphrases('{path}', 0.5)")
  batch = {
    "caption": np.array([b"a red cube.", b"a red cube.", b"a blue ball.", b""], object),
    "caption_q": np.array([b"red cube.", b"a red.", b"blue ball.", b""], object),
    "caption_k": np.array([b"a cube.", b"red a cube.", b"a ball.", b""], object),
    # Per view: u < 0.5 picks paraphrase int(u / 0.5 * 2); u >= 0.5 keeps the offline view.
    "paraphrase_u": np.array([[0.1, 0.3], [0.9, 0.49], [0.0, 0.0], [0.0, 0.0]]),
  }
  out = pp.batch_fn(batch)
  assert list(out["caption_q"]) == ["one red cube.", "a red.", "blue ball.", ""]
  assert list(out["caption_k"]) == ["a cube that is red.", "a cube that is red.", "a ball.", ""]
  np.testing.assert_array_equal(out["stat_no_paraphrase"], [False, False, True, False])  # empty caption: not counted
  draws = pp.example_fn({"_rng": tf.constant([3, 4], tf.int64)})["paraphrase_u"].numpy()
  again = pp.example_fn({"_rng": tf.constant([3, 4], tf.int64)})["paraphrase_u"].numpy()
  assert draws.shape == (2,) and (draws == again).all()  # a pure function of the example's seed
  (tmp_path / "empty.json").write_text(json.dumps({"x": [""]}))
  with pytest.raises(ValueError, match="no paraphrases"):
    registry.parse(f"paraphrases('{tmp_path / 'empty.json'}')")


def test_pretrained_bert_text_tower_loads_into_query_and_momentum_towers():
  """text=bert: the packaged MiniLM's weights (first layer) land in the text tower and in its momentum copy, the
  tower's token states are BERT's own, and a model without them embeds captions differently."""
  import optax
  import tiny_mct

  from vlrep import methods, sharding, train_state
  from vlrep.data import tokenizers
  from vlrep.models import bert as bert_lib
  from vlrep.train_step import init_train_state

  config = tiny_mct.get_config("text=bert,bert_layers=1")
  assert config.tokenizer.kind == "wordpiece" and config.method.text_tower == "bert"
  tokenizer = tokenizers.ensure_tokenizer(config.tokenizer, None)
  method = methods.build(config.method, tokenizer.vocab_size)
  _, base, batch = _tiny_method_and_batch()
  ids = [tokenizer.encode(t, 12)[0] for t in ("a red circle left of a blue square", "two green triangles", "a", "b")]
  batch.update(tokens_q=np.stack(ids * 2), tokens_k=np.stack(ids[::-1] * 2))
  tx = optax.sgd(0.1)
  fresh = init_train_state(method, tx, jax.random.PRNGKey(0), batch)
  state_sh = sharding.state_shardings(sharding.make_mesh(), fresh, "replicate")
  state = train_state.load_pretrained_variables(fresh, train_state.pretrained_variables_of(method), tx, state_sh)

  bert_config, want, _, _ = bert_lib.load_pretrained("minilm")
  bert_config, want = bert_lib.first_layers(bert_config, want, 1)
  assert "layer_1" not in state["params"]["textual"] and bert_config.hidden_size == 384
  for tree in (state["params"]["textual"], state["model_state"]["momentum"]["params"]["textual"]):
    jax.tree.map(np.testing.assert_array_equal, tree, want)
  # Everything else is the fresh init, untouched (the image tower, the heads, the queues).
  jax.tree.map(np.testing.assert_array_equal, state["params"]["backbone"], fresh["params"]["backbone"])
  jax.tree.map(np.testing.assert_array_equal, state["model_state"]["queues"], fresh["model_state"]["queues"])
  # The tower runs BERT: its token states are BertEncoder's with the checkpoint's weights.
  tokens = jnp.asarray(batch["tokens_q"][:4])
  ref, _ = bert_lib.BertEncoder(bert_config).apply({"params": want}, tokens)
  got, _ = method.model.apply({"params": state["params"]}, tokens, method=lambda m, t: m.textual(t, mask=t != 0))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  variables = {"params": state["params"], "batch_stats": state["model_state"]["batch_stats"]}
  loaded = np.asarray(method.embed(variables, tokens=tokens)["text"])
  variables["params"] = fresh["params"]
  assert np.abs(loaded - np.asarray(method.embed(variables, tokens=tokens)["text"])).max() > 1e-3
  # A train step on the loaded state is finite.
  loss, metrics, _ = method.loss({"params": state["params"], **state["model_state"]}, batch,
                                 jax.random.PRNGKey(1), True)  # fmt: skip
  assert np.isfinite(float(loss)), metrics
  # Pretrained values for a part the model does not have are refused by name.
  with pytest.raises(ValueError, match="momentum/params/no_such_tower"):
    train_state.load_pretrained_variables(fresh, {"model_state": {"momentum": {"params": {"no_such_tower": want}}}},
                                          tx, state_sh)  # fmt: skip
  # A tokenizer that is not BERT's is refused.
  with pytest.raises(ValueError, match="wordpiece"):
    methods.build(config.method, 200)


def test_pretrained_bert_text_tower_trains_with_dropout_set_by_the_config():
  """text=bert: while training, the text tower applies BERT's fine-tuning dropout at method.bert_dropout (0.1 in
  the recipe, 0 in runlocal); evaluation and rate 0 give the dropout-free tower; < 0 keeps config.json's rates;
  >= 1 is refused."""
  import tiny_mct

  from vlrep import methods, train_state
  from vlrep.data import tokenizers

  assert tiny_mct.mct.get_config("text=bert").method.bert_dropout == 0.1  # the recipe's rate (runlocal's is 0)
  config = tiny_mct.get_config("text=bert,bert_layers=1,head_bn=none")
  assert config.method.bert_dropout == 0.0
  tokenizer = tokenizers.ensure_tokenizer(config.tokenizer, None)
  ids = [tokenizer.encode(t, 12)[0] for t in ("a red circle left of a blue square", "two green triangles")]
  tokens = jnp.asarray(np.stack(ids))
  embed = lambda m, t, train: m.embed_texts(t, train)["inter"]

  def build(rate):
    config.method.bert_dropout = rate
    return methods.build(config.method, tokenizer.vocab_size)

  method = build(0.1)
  params = method.model.init(jax.random.PRNGKey(0), tokens, False, method=embed)["params"]
  params["textual"] = train_state.pretrained_variables_of(method)["params"]["textual"]

  def text_embeddings(method, train, seed=0):
    rngs = {"dropout": jax.random.PRNGKey(seed)}
    return np.asarray(method.model.apply({"params": params}, tokens, train, method=embed, rngs=rngs))

  clean = text_embeddings(method, train=False)
  assert method.model.bert.hidden_dropout_prob == 0.1 == method.model.bert.attention_probs_dropout_prob
  dropped = text_embeddings(method, train=True)
  assert np.abs(dropped - clean).max() > 1e-3
  assert np.abs(dropped - text_embeddings(method, train=True, seed=1)).max() > 1e-3
  np.testing.assert_array_equal(text_embeddings(build(0.0), train=True), clean)
  assert build(0.3).model.bert.attention_probs_dropout_prob == 0.3
  # < 0: the packaged MiniLM's config.json rates (0.1 and 0.1).
  keep = build(-1.0).model.bert
  assert (keep.hidden_dropout_prob, keep.attention_probs_dropout_prob) == (0.1, 0.1)
  with pytest.raises(ValueError, match="bert_dropout"):
    build(1.0)


def test_the_tag_set_is_said_to_be_built_from_tags(tmp_path, monkeypatch, caplog):
  """MCT's tag set on own data (concepts.kind='tags', corpus_key='tags') is built from the examples' tags: the log
  says "tags" (it said "captions")."""
  import types

  from ml_collections import ConfigDict

  from vlrep.data import concepts, records

  tags = ["cat", "animal", "cat", "sofa", "cup", "coffee", "cat"]
  monkeypatch.setattr(records, "read_texts", lambda builder, split, key: list(tags) if key == "tags" else [])
  builder = types.SimpleNamespace(name="image_text", data_dir=str(tmp_path))
  config = ConfigDict(
    dict(kind="tags", size=3, corpus_split="train[5%:]", corpus_key="tags", path=str(tmp_path / "tags.json"))
  )
  with caplog.at_level("INFO"):
    built = concepts.ensure_concepts(config, builder, None)
  said = [r.getMessage() for r in caplog.records if "Building concept set" in r.getMessage()]
  assert said == [f"Building concept set {tmp_path / 'tags.json'} (tags) from 7 tags of image_text/train[5%:]."]
  assert len(built) == 3 and "cat" in built.words
