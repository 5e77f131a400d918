"""ICMLM: Flax BERT against Hugging Face's PyTorch BERT on the packaged MiniLM, pickle-free checkpoint reading,
bad BERT folders, concept sets, the losses and att-fc pooling, masking, and end-to-end runs whose frozen BERT
stays bit-identical."""

import dataclasses
import json
import os
import pickle
import re
import shutil
import zipfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_main

from vlrep import torch_files
from vlrep.data import concepts as concepts_lib
from vlrep.data.wordpiece import WordPieceTokenizer
from vlrep.methods import icmlm
from vlrep.models import bert
from vlrep.models.icmlm import AttentionPooling

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CAPTIONS = [
  "A man riding a large brown horse.",
  "Two dogs are sitting on a green bench near the horse!",
  "the man is holding a red umbrella",
]


@pytest.fixture(scope="module")
def minilm():
  return bert.load_pretrained("minilm")


# ---------------------------------------------------------------------------------------------------------
# BERT and its tokenizer against Hugging Face's implementations.
# ---------------------------------------------------------------------------------------------------------
def test_flax_bert_reproduces_the_packaged_checkpoint_in_pytorch(minilm):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config, params, head, folder = minilm
  assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (384, 6, 30522)
  assert head is None  # MiniLM is fine-tuned for sentence embeddings: no MLM head
  tok = WordPieceTokenizer(folder)
  ids = np.stack([tok.encode(t, 20)[0] for t in CAPTIONS])
  mask = ids != 0
  assert mask.sum(1).min() < 20  # padding present, so the attention mask matters
  ref = transformers.BertModel.from_pretrained(folder).eval()
  with torch.no_grad():
    out = ref(
      input_ids=torch.tensor(ids, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      output_hidden_states=True,
    )
  hidden, aux = bert.BertEncoder(config).apply({"params": params}, jnp.asarray(ids))
  np.testing.assert_allclose(np.asarray(hidden)[mask], out.last_hidden_state.numpy()[mask], atol=2e-5)
  np.testing.assert_allclose(np.asarray(aux["pooled"]), out.pooler_output.numpy(), atol=2e-5)
  for ours, theirs in zip(aux["hidden_states"], out.hidden_states, strict=True):
    np.testing.assert_allclose(np.asarray(ours)[mask], theirs.numpy()[mask], atol=2e-5)
  # Not trivially equal: different captions give different states.
  assert np.abs(np.asarray(hidden)[0, 1] - np.asarray(hidden)[1, 1]).max() > 0.1


def test_bert_dropout_is_off_by_default_and_where_hugging_face_puts_it_when_training(tmp_path, minilm):
  """deterministic=True (ICMLM's frozen BERT, evaluation) is dropout-free; deterministic=False drops the
  embeddings' output (exactly: each entry zeroed or scaled by 1 / (1 - p)), the attention weights and both residual
  branches, with config.json's rates."""
  config, params, _, folder = minilm
  assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.1, 0.1)  # MiniLM's config.json
  ids = jnp.asarray(np.stack([WordPieceTokenizer(folder).encode(t, 20)[0] for t in CAPTIONS]))
  mask = np.asarray(ids) != 0

  def run(cfg, deterministic=True, seed=0):
    hidden, aux = bert.BertEncoder(cfg).apply(
      {"params": params}, ids, deterministic=deterministic, rngs={"dropout": jax.random.PRNGKey(seed)}
    )
    return np.asarray(hidden), [np.asarray(h) for h in aux["hidden_states"]]

  clean, clean_states = run(config)
  # Rates of zero: the training path is the evaluation path.
  zero = dataclasses.replace(config, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  np.testing.assert_array_equal(run(zero, deterministic=False)[0], clean)
  # The embeddings' dropout, exactly.
  _, states = run(config, deterministic=False)
  emb, ref = states[0][mask], clean_states[0][mask]
  dropped = emb == 0
  assert 0.07 < dropped.mean() < 0.13, dropped.mean()
  np.testing.assert_allclose(emb[~dropped], ref[~dropped] / 0.9, rtol=1e-5, atol=1e-6)
  # Each kind alone changes the output; the same rng gives the same output, another rng another.
  only_attention = dataclasses.replace(config, hidden_dropout_prob=0.0)
  attention_out = run(only_attention, deterministic=False)[0]
  np.testing.assert_array_equal(attention_out[:, 0], run(only_attention, deterministic=False)[0][:, 0])
  assert np.abs(attention_out - clean)[mask].max() > 1e-2
  assert np.abs(attention_out - run(only_attention, deterministic=False, seed=1)[0])[mask].max() > 1e-2
  hidden_only = dataclasses.replace(config, attention_probs_dropout_prob=0.0)
  assert np.abs(run(hidden_only, deterministic=False)[0] - clean)[mask].max() > 1e-2
  # A config.json without the dropout keys gets Hugging Face's defaults.
  raw = json.load(open(os.path.join(folder, "config.json")))
  raw.update(hidden_dropout_prob=0.25)
  del raw["attention_probs_dropout_prob"]
  (tmp_path / "config.json").write_text(json.dumps(raw))
  read = bert.BertConfig.from_json(str(tmp_path / "config.json"))
  assert (read.hidden_dropout_prob, read.attention_probs_dropout_prob) == (0.25, 0.1)
  # The config knob: < 0 keeps config.json's rates, >= 0 sets both, >= 1 is refused.
  assert bert.with_dropout(read, -1.0) == read
  both = bert.with_dropout(read, 0.3)
  assert (both.hidden_dropout_prob, both.attention_probs_dropout_prob, both.hidden_size) == (0.3, 0.3, read.hidden_size)
  with pytest.raises(ValueError, match="bert_dropout"):
    bert.with_dropout(read, 1.0)


def test_wordpiece_tokenizer_matches_bert_tokenizer(minilm):
  transformers = pytest.importorskip("transformers")
  folder = minilm[3]
  ours, ref = WordPieceTokenizer(folder), transformers.BertTokenizer.from_pretrained(folder)
  texts = CAPTIONS + ["Unaffable café-goers, naïve 東京 tower\tover\u200bthere $5^2", "x" * 120, "", "don't stop!!"]
  for t in texts:
    assert ours.tokenize(t) == ref.tokenize(t), t
    ids, truncated = ours.encode(t, 16)
    want = ref(t, max_length=16, truncation=True, padding="max_length")["input_ids"]
    assert ids.tolist() == want, t
  assert ours.tokenize("unaffable") == ["una", "##ffa", "##ble"]
  assert ours.decode(ours.encode("a red umbrella", 8)[0]) == "a red umbrella"


def test_pytorch_bin_is_read_without_executing_pickles(tmp_path, minilm):
  torch = pytest.importorskip("torch")
  config, params, _, folder = minilm
  from safetensors.numpy import load_file

  sd = load_file(os.path.join(folder, "model.safetensors"))
  sd["cls.predictions.transform.dense.weight"] = np.eye(384, dtype=np.float32)[::-1].copy()
  sd["cls.predictions.transform.dense.bias"] = np.arange(384, dtype=np.float32)
  sd["cls.predictions.transform.LayerNorm.weight"] = np.ones(384, np.float32)
  sd["cls.predictions.transform.LayerNorm.bias"] = np.zeros(384, np.float32)
  sd["cls.predictions.bias"] = np.linspace(-1, 1, 30522).astype(np.float32)
  out = tmp_path / "bert_bin"
  out.mkdir()
  for f in ("config.json", "vocab.txt"):
    shutil.copy(os.path.join(folder, f), out / f)
  # A transposed (non-contiguous) tensor and a half-precision one exercise strides and dtypes.
  state = {("bert." + k if not k.startswith("cls.") else k): torch.from_numpy(v.copy()) for k, v in sd.items()}
  state["bert.pooler.dense.weight"] = torch.from_numpy(sd["pooler.dense.weight"].T.copy()).t()
  torch.save(state, out / "pytorch_model.bin")
  config2, params2, head2, _ = bert.load_pretrained(str(out))
  assert config2 == config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(head2["transform"]["kernel"], sd["cls.predictions.transform.dense.weight"].T)
  np.testing.assert_array_equal(head2["bias"], sd["cls.predictions.bias"])

  # The same weights in torch's legacy format (torch < 1.6) load to the same parameters.
  torch.save(state, out / "pytorch_model.bin", _use_new_zipfile_serialization=False)
  _, params3, _, _ = bert.load_pretrained(str(out))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params3), strict=True):
    np.testing.assert_array_equal(a, b)

  # A pickle that would run code is refused where it asks for the callable, naming the file and the global (nothing
  # is imported or called: tests/test_safe_loading.py crafts every kind), and a BERT file that holds a plain
  # non-tensor where a tensor belongs is an error naming the key.
  class Evil:
    def __reduce__(self):
      return (os.system, ("touch " + str(tmp_path / "pwned"),))

  evil = tmp_path / "evil.bin"
  with zipfile.ZipFile(evil, "w") as z:
    z.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}, protocol=2))
  with pytest.raises(torch_files.UnsafeFile, match=re.escape(str(evil)) + r".* asks for posix\.system"):
    torch_files.load_checkpoint(str(evil))
  for legacy in (False, True):
    state["bert.embeddings.word_embeddings.weight"] = Evil()
    torch.save(state, out / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    with pytest.raises(torch_files.UnsafeFile, match=r"pytorch_model\.bin.* asks for posix\.system"):
      bert.load_pretrained(str(out))
    state["bert.embeddings.word_embeddings.weight"] = [1.0, 2.0]
    torch.save(state, out / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ValueError, match=r"not tensors: \['bert\.embeddings\.word_embeddings\.weight'\]"):
      bert.load_pretrained(str(out))
  assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_torch_files_rebuilds_dtypes_scalars_and_views(tmp_path, legacy):
  torch = pytest.importorskip("torch")
  base = torch.arange(24, dtype=torch.float32)
  obj = {
    "bfloat16": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
    "half": torch.tensor([0.5, 65504.0], dtype=torch.float16),
    "double": torch.tensor([1e-300], dtype=torch.float64),
    "int8": torch.tensor([-3, 7], dtype=torch.int8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(7.5),
    "int_scalar": torch.tensor(42),  # e.g. BatchNorm's num_batches_tracked
    "view": base[5:17].view(3, 4).t(),  # an offset into a storage another tensor shares, transposed
    "base": base,
    "param": torch.nn.Parameter(torch.ones(2, 3)),
  }
  ckpt = {"model": obj, "optimizer": {"step": torch.tensor(3)}, "epochs": [1, (2, "x")]}
  path = tmp_path / "ckpt.pth"
  torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy)
  assert zipfile.is_zipfile(path) is not legacy
  got = torch_files.load_checkpoint(str(path))
  assert got["epochs"] == [1, (2, "x")] and int(got["optimizer"]["step"]) == 3
  sd = torch_files.load_state_dict(str(path))  # the tensors under 'model'
  assert sd.keys() == obj.keys()
  for k, t in obj.items():
    want = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
    assert sd[k].shape == want.shape and sd[k].dtype.itemsize == t.element_size(), k
    np.testing.assert_array_equal(sd[k].astype(want.dtype), want, err_msg=k)
  assert sd["bfloat16"].dtype == ml_dtypes.bfloat16 and sd["int_scalar"].dtype == np.int64
  assert sd["view"].flags.owndata  # a copy, not a view into the file's bytes


def test_bad_bert_folders_are_clear_errors(tmp_path, minilm):
  folder = minilm[3]
  good = tmp_path / "good"
  shutil.copytree(folder, good)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    bert.load_pretrained(str(tmp_path / "nowhere"))
  for missing, message in (("vocab.txt", "lacks vocab.txt"), ("config.json", "lacks config.json")):
    d = tmp_path / f"no_{missing}"
    shutil.copytree(good, d)
    os.remove(d / missing)
    with pytest.raises(FileNotFoundError, match=message):
      bert.load_pretrained(str(d))
  d = tmp_path / "no_weights"
  shutil.copytree(good, d)
  os.remove(d / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model.bin"):
    bert.load_pretrained(str(d))
  # config.json that does not match the weights.
  d = tmp_path / "mismatch"
  shutil.copytree(good, d)
  cfg = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 1024}))
  wrong = r"\['intermediate'\]\['bias'\] has shape \(1536,\) but config.json implies \(1024,\)"
  with pytest.raises(ValueError, match=wrong):
    bert.load_pretrained(str(d))
  (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 7}))
  with pytest.raises(ValueError, match="lacks tensor 'encoder.layer.6"):
    bert.load_pretrained(str(d))
  (d / "config.json").write_text(json.dumps(cfg))
  (d / "vocab.txt").write_text("[PAD]\n[UNK]\n")
  with pytest.raises(ValueError, match="vocab.txt has 2 entries but config.json says 30522"):
    bert.load_pretrained(str(d))


# ---------------------------------------------------------------------------------------------------------
# Concept sets.
# ---------------------------------------------------------------------------------------------------------
def test_concept_sets_from_hand_written_captions(minilm):
  tok = WordPieceTokenizer(minilm[3])
  captions = CAPTIONS + ["A brown horse and a man.", "a horse"]
  nouns = concepts_lib.postag_concepts(captions, 10, ("NOUN",), tok)
  # horse 4x, man 3x, then the single ones alphabetically.
  assert nouns.words == ["horse", "man", "bench", "dogs", "umbrella"]
  assert nouns.token_ids.tolist() == [tok.ids[w] for w in nouns.words]
  adj = concepts_lib.postag_concepts(captions, 10, ("NOUN", "ADJ"), tok)
  assert set(adj.words) == {"horse", "man", "bench", "dogs", "umbrella", "brown", "large", "green", "red"}
  assert adj.words[:3] == ["horse", "man", "brown"]
  every = concepts_lib.postag_concepts(captions, 3, ("NOUN", "ADJ", "VERB"), tok)
  assert every.words == ["horse", "man", "brown"]  # K caps the set
  verbs = concepts_lib.postag_concepts(captions, 10, ("VERB",), tok)
  assert verbs.words == ["holding", "riding", "sitting"]
  np.testing.assert_array_equal(nouns.tags(["two dogs near a horse", "nothing here"]), [1, 0, 0, 1, 0])
  # Words that are not one WordPiece cannot be masked as one token: dropped and counted.
  rare = concepts_lib.postag_concepts(["a zebroid and a horse"], 10, ("NOUN",), tok)
  assert rare.words == ["horse"] and rare.meta["not_one_piece"] == 1
  with pytest.raises(ValueError, match="concept set is empty"):
    concepts_lib.postag_concepts(["the and of a", ""], 10, ("NOUN",), tok)
  with pytest.raises(ValueError, match="non-empty subset"):
    concepts_lib.postag_concepts(captions, 10, ("ADVERB",), tok)


def test_cluster_concepts_group_similar_captions(tmp_path):
  # A fake embedder with two obvious groups: k-means must split them, and tags follow the captions' clusters.
  def embed(texts):
    return np.array([[1.0, 0.0] if "dog" in t else [0.0, 1.0] for t in texts]) + 0.01 * np.arange(len(texts))[:, None]

  caps = ["a dog runs", "the dog sleeps", "a dog!", "a red car", "the car is parked", "car"]
  clusters = concepts_lib.cluster_concepts(caps, 2, embed)
  k_dog, k_car = clusters.caption_cluster["a dog runs"], clusters.caption_cluster["car"]
  assert k_dog != k_car and clusters.caption_cluster["the dog sleeps"] == k_dog
  tags = clusters.tags(["A dog!", "a red car", "never seen"])  # normalised like the builder's keys
  assert tags.tolist() == [1.0, 1.0]
  assert clusters.tags(["a dog runs"])[k_car] == 0
  with pytest.raises(ValueError, match="cannot make 10 clusters"):
    concepts_lib.cluster_concepts(caps, 10, embed)
  # A cached file round-trips; a corrupt one is a clear error.
  path = str(tmp_path / "clusters.json")
  clusters.save(path)
  assert concepts_lib.ConceptSet.load(path).caption_cluster == clusters.caption_cluster
  with open(path, "w") as f:
    f.write('{"kind": "cluster", "wor')
  with pytest.raises(ValueError, match="corrupt.*delete it to rebuild"):
    concepts_lib.ConceptSet.load(path)


# ---------------------------------------------------------------------------------------------------------
# Losses, masking and att-fc pooling.
# ---------------------------------------------------------------------------------------------------------
def test_normalized_tag_loss_matches_numpy_and_skips_untagged_images():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 6)).astype(np.float32)
  tags = np.array([[1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0] * 6, [1, 0, 0, 0, 0, 1]], np.float32)
  logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  want = np.mean([-(logp[i] * tags[i]).sum() / tags[i].sum() for i in (0, 1, 3)])
  np.testing.assert_allclose(float(icmlm.normalized_tag_loss(jnp.asarray(logits), jnp.asarray(tags))), want, rtol=1e-5)


def test_masking_picks_concepts_uniformly_and_flags_captions_without_one():
  concept = jnp.zeros((20,), bool).at[jnp.array([7, 9])].set(True)
  tokens = jnp.array([[101, 7, 3, 9, 102, 0], [101, 4, 5, 102, 0, 0]] * 500)
  picks, has = [], []
  for i in range(4):
    pos, h = icmlm.choose_masked_concepts(tokens, concept, jax.random.PRNGKey(i))
    picks.append(np.asarray(pos)[::2])
    has.append(np.asarray(h))
  picks, has = np.concatenate(picks), np.concatenate(has)
  assert set(np.unique(picks)) == {1, 3}  # only concept positions
  assert abs(np.mean(picks == 1) - 0.5) < 0.05  # uniform among them
  assert has[::2].all() and not has[1::2].any()


def test_att_fc_pooling_weights_sum_to_one_and_ignore_padding():
  rng = np.random.default_rng(0)
  grid = jnp.asarray(rng.normal(size=(3, 12, 8)), jnp.float32)
  words = jnp.asarray(rng.normal(size=(3, 5, 6)), jnp.float32)
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
  module = AttentionPooling(dim=4, num_heads=3)
  params = module.init(jax.random.PRNGKey(0), grid, words, mask)
  pooled, p = module.apply(params, grid, words, mask)
  np.testing.assert_allclose(np.asarray(p).sum(1), 1.0, rtol=1e-6)
  assert (np.asarray(p) > 0).all() and np.asarray(p).std() > 0  # not uniform
  np.testing.assert_allclose(np.asarray(pooled), np.einsum("bn,bnd->bd", np.asarray(p), np.asarray(grid)), rtol=1e-5)
  # Padded token features do not change the attention.
  noisy = words.at[0, 3:].set(100.0)
  np.testing.assert_allclose(np.asarray(module.apply(params, grid, noisy, mask)[1]), np.asarray(p), rtol=1e-6)


def test_captions_without_a_concept_are_skipped_and_counted(minilm):
  import tiny_icmlm

  from vlrep import methods

  tok = WordPieceTokenizer(minilm[3])
  concepts = concepts_lib.postag_concepts(CAPTIONS, 10, ("NOUN", "ADJ"), tok)
  config = tiny_icmlm.get_config("variant=tfm")
  method = methods.build(config.method, tok.vocab_size, concepts=concepts)
  rng = np.random.default_rng(0)
  captions = ["a man on a horse", "of the and it", "a red bench", ""]
  batch = {
    "image": rng.normal(size=(4, 32, 32, 3)).astype(np.float32),
    "tokens": np.stack([tok.encode(c, 12)[0] for c in captions]),
    "tags": np.stack([concepts.tags([c]) for c in captions]),
    "stat_empty": np.array([False, False, False, True]),
  }
  variables = jax.jit(method.init)(jax.random.PRNGKey(0), batch)
  variables["bert"] = minilm[1]
  loss_fn = jax.jit(method.loss, static_argnames="train")
  loss, metrics, _ = loss_fn(variables, batch, jax.random.PRNGKey(1), train=False)
  # Caption 1 has no concept (counted); caption 3 is empty (counted as empty by the pipeline, not here).
  assert float(metrics["captions_without_concept"]) == 1.0
  # l_mlm averages over captions 0 and 2 only: replacing the skipped captions changes nothing.
  other = dict(batch, tokens=batch["tokens"].copy())
  other["tokens"][1] = tok.encode("the of it", 12)[0]
  other["tokens"][3] = tok.encode("and", 12)[0]
  _, metrics2, _ = loss_fn(variables, other, jax.random.PRNGKey(1), train=False)
  np.testing.assert_allclose(float(metrics["mlm_loss"]), float(metrics2["mlm_loss"]), rtol=1e-6)
  assert np.isfinite(float(loss)) and float(metrics["mlm_loss"]) > 0
  # ICMLM without a concept set (or an empty one) is a clear error.
  config.method.num_tags = 0
  with pytest.raises(ValueError, match="non-empty postag concept set"):
    methods.build(config.method, tok.vocab_size, concepts=None)


def test_visual_attention_metric_is_the_masked_tokens_share_on_the_image(minilm):
  """`visual_attention`: tfm's masked-token attention mass on the visual tokens; att-fc's largest pooling weight.
  With the key projection (tfm) or head mixing (att-fc) zeroed every score is equal, so the exact values are
  known: cells / (cells + the caption's non-padding tokens), and 1 / cells."""
  import tiny_icmlm

  from vlrep import methods

  tok = WordPieceTokenizer(minilm[3])
  concepts = concepts_lib.postag_concepts(CAPTIONS, 10, ("NOUN", "ADJ"), tok)
  tokens = np.stack([tok.encode(c, 16)[0] for c in CAPTIONS])
  batch = {"image": np.random.default_rng(0).normal(size=(3, 64, 64, 3)).astype(np.float32), "tokens": tokens}
  batch["tags"] = np.stack([concepts.tags([c]) for c in CAPTIONS])
  lengths = (tokens != 0).sum(1)
  for variant in ("tfm", "att_fc"):
    config = tiny_icmlm.get_config(f"variant={variant}")
    method = methods.build(config.method, tok.vocab_size, concepts=concepts)
    variables = jax.jit(method.init)(jax.random.PRNGKey(0), batch)
    variables["bert"] = minilm[1]
    loss_fn = jax.jit(method.loss, static_argnames="train")
    _, metrics, state = loss_fn(variables, batch, jax.random.PRNGKey(1), train=False)
    assert 0 < float(metrics["visual_attention"]) < 1 and "intermediates" not in state
    if variant == "tfm":  # the masked token's row, found here by hand from the same masking draw
      pos = np.asarray(
        icmlm.choose_masked_concepts(tokens, method.concept_mask, jax.random.split(jax.random.PRNGKey(1))[0])[0]
      )
      _, inter = method._apply(variables, batch["image"], tokens, pos, jax.random.PRNGKey(0), False, ("intermediates",))
      weights = np.asarray(inter["intermediates"]["tfm_0"]["self_attention_weights"][0]).mean(1)  # [B, S, S]
      by_hand = np.mean([weights[i, 4 + pos[i], :4].sum() for i in range(3)])
      np.testing.assert_allclose(float(metrics["visual_attention"]), by_hand, rtol=1e-5)
    params = jax.tree.map(lambda x: x, variables["params"])
    if variant == "tfm":
      key = params["tfm_0"]["self_attention"]["key"]
      key["kernel"] = jnp.zeros_like(key["kernel"])  # (the key projection has no bias)
      expected = np.mean(4 / (4 + lengths))  # 64 px through the ResNet: a 2x2 grid
    else:
      params["att"]["sigma_h"]["kernel"] = jnp.zeros_like(params["att"]["sigma_h"]["kernel"])
      expected = 1 / 4
    _, metrics, _ = loss_fn({**variables, "params": params}, batch, jax.random.PRNGKey(1), train=False)
    np.testing.assert_allclose(float(metrics["visual_attention"]), expected, rtol=1e-5)


def test_lambda_defaults_follow_the_recipe():
  from configs import icmlm

  weight = lambda arg: icmlm.get_config(arg).method.tp_weight
  assert weight("variant=tfm") == 0.1  # the paper's ResNet-50 lambda
  assert weight("variant=att_fc,backbone=vgg16") == 1.0  # the paper's VGG16 lambda
  assert weight("runlocal,variant=tfm") == weight("runlocal,variant=att_fc") == 1.0  # docs/results/icmlm.md
  assert weight("runlocal,variant=tfm,tp_weight=0.1") == 0.1  # an explicit lambda is kept
  assert weight("variant=tfm,backbone=vgg16,tp_weight=0") == 0.0
  assert weight("runlocal,variant=tp") == 1.0  # TP is l_tp alone


def test_recipes_need_a_bert_folder_and_only_runlocal_defaults_to_minilm():
  from configs import icmlm, mct, vlbert

  recipes = [icmlm.get_config("variant=tfm"), vlbert.get_config(), mct.get_config("text=bert")]
  for c in recipes:
    assert c.method.bert_path == "" and c.tokenizer.path == ""
    with pytest.raises(ValueError, match="bert-base-uncased.*config.json, vocab.txt"):
      bert.resolve_path(c.method.bert_path)
  local = [
    icmlm.get_config("runlocal,variant=tfm"),
    vlbert.get_config("runlocal"),
    mct.get_config("runlocal,text=bert"),
  ]
  assert all(c.method.bert_path == c.tokenizer.path == "minilm" for c in local)
  assert icmlm.get_config("variant=tfm,bert=/data/bert").method.bert_path == "/data/bert"
  assert os.path.isfile(os.path.join(bert.resolve_path("minilm"), "config.json"))


def test_recipe_filters_captions_and_requires_spacy_where_runlocal_uses_the_lexicon(monkeypatch):
  import tensorflow as tf

  from configs import icmlm
  from vlrep.data import registry

  recipe, local = icmlm.get_config("variant=tp"), icmlm.get_config("runlocal,variant=tp")
  assert "filter_captions(3, 25)|choose_caption(5)" in recipe.data.pp and "filter_captions" not in local.data.pp
  assert recipe.concepts.tagger == "spacy" and local.concepts.tagger == "lexicon"
  # The paper's filter: duplicates (case and outer spaces aside; the first copy stays) and < 3 or > 25 words go.
  captions = ["A red circle.", "a red circle. ", "too short", "a horse", " ".join(["word"] * 26), "Two dogs run."]
  out = registry.parse("filter_captions(3, 25)").example_fn({"captions": tf.constant(captions)})
  assert [c.decode() for c in out["captions"].numpy()] == ["A red circle.", "Two dogs run."]
  assert int(out["stat_captions_filtered"]) == 4
  out = registry.parse("filter_captions(3, 25)").example_fn({"captions": tf.constant([], tf.string)})
  assert out["captions"].shape == (0,) and int(out["stat_captions_filtered"]) == 0
  # Without spaCy the recipe's tagger is an error that says how to install it; the lexicon needs nothing.
  monkeypatch.setattr(concepts_lib, "_spacy_model", lambda: None)
  with pytest.raises(RuntimeError, match="pip install 'vlrep\\[icmlm\\]'.*en_core_web_sm"):
    concepts_lib.resolve_tagger(recipe.concepts.tagger)
  assert concepts_lib.resolve_tagger("lexicon") == "lexicon"


def test_vgg16_backbone_option_builds_every_variant(minilm):
  import tiny_icmlm

  from vlrep import methods

  tok = WordPieceTokenizer(minilm[3])
  concepts = concepts_lib.postag_concepts(CAPTIONS, 10, ("NOUN", "ADJ"), tok)
  recipe = tiny_icmlm.icmlm.get_config("variant=att_fc,backbone=vgg16")
  assert recipe.method.backbone.arch == "vgg16" and recipe.method.tp_head == "cnn" and recipe.method.tp_weight == 1
  config = tiny_icmlm.get_config("variant=att_fc,backbone=vgg16")
  config.method.backbone = dict(arch="vgg16", width=8)
  method = methods.build(config.method, tok.vocab_size, concepts=concepts)
  batch = {
    "image": np.zeros((2, 64, 64, 3), np.float32),
    "tokens": np.stack([tok.encode(c, 12)[0] for c in CAPTIONS[:2]]),
    "tags": np.ones((2, len(concepts)), np.float32),
  }
  variables = jax.jit(method.init)(jax.random.PRNGKey(0), batch)
  assert sorted(variables["params"]["backbone"])[:2] == ["bn1_1", "bn1_2"]
  assert variables["params"]["tp"]["conv4"]["kernel"].shape[-1] == config.method.tp_hidden  # 4-layer CNN tp
  feats = jax.jit(method.features)(variables, batch["image"])
  assert feats["grid"].shape == (2, 2, 2, 64)  # pool5: stride 32, 512 * 8 / 64 channels
  with pytest.raises(ValueError, match="Unknown backbone"):
    tiny_icmlm.get_config("backbone=vgg19")


# ---------------------------------------------------------------------------------------------------------
# End to end.
# ---------------------------------------------------------------------------------------------------------
def test_icmlm_tfm_trains_with_a_frozen_bert_and_evaluates_masked_tokens(tmp_path, minilm):
  workdir = tmp_path / "tfm"
  proc = run_main(workdir, config="tests/tiny_icmlm.py:variant=tfm")
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 6
  assert 0 <= summary["masked_tokens/top1"] <= summary["masked_tokens/top5"] <= 100
  assert summary["masked_tokens/count"] > 8  # several concept occurrences per caption
  assert "probe/map" in summary and np.isfinite(summary["train/loss"])
  # The frozen BERT in the final checkpoint is bit-identical to the packaged weights; the heads moved.
  from vlrep import runs

  run = runs.load_run(str(workdir), "latest")
  saved = run.model_state["bert"]
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(minilm[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert "bert" not in run.params
  assert "captions_without_concept" in proc.stderr
  # The masked-token attention maps (the paper's figures 1 and 3): one PNG per concept word of the caption.
  from vlrep.tools import masked_attention

  images = np.random.default_rng(0).integers(0, 255, (1, 32, 32, 3), dtype=np.uint8)
  out = masked_attention.render(
    str(workdir), str(tmp_path / "maps"), images, ["a red square left of a circle"], ["x"], "latest", upscale=2
  )
  assert set(out["x"]["words"]) <= {"red", "square", "left", "circle"} and out["x"]["words"]
  assert all(os.path.exists(p) for p in out["x"]["pngs"]) and len(out["x"]["pngs"]) == len(out["x"]["words"])
  assert all(len(p) == 5 for p in out["x"]["predictions"]) and os.path.exists(out["x"]["strip"])


def test_tp_variants_and_att_fc_warmup_with_a_frozen_backbone(tmp_path, minilm):
  # TP_Cluster builds k-means clusters of MiniLM [CLS] vectors of the tiny captions (TP_Postag and TP_Label differ
  # only in the tag op, `concept_tags` / `tags`, both used elsewhere in these tests).
  workdir = tmp_path / "cluster"
  proc = run_main(workdir, config="tests/tiny_icmlm.py:variant=tp,tags=cluster")
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert "probe/map" in summary and "masked_tokens/top1" not in summary
  assert re.search(r"Concept set .*cluster\d+.*: \d+ cluster concepts", proc.stderr), proc.stderr[-3000:]
  # ICMLM_att-fc with warmup_frozen=4: the backbone (parameters and BatchNorm statistics) does not move during the
  # first 4 steps (the attention and fc heads do), then it does; BERT never does.
  from vlrep import runs

  workdir = tmp_path / "warm"
  proc = run_main(
    workdir, "--config.checkpoint.every_steps=1", config="tests/tiny_icmlm.py:variant=att_fc,warmup_frozen=4"
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  runs = {s: runs.load_run(str(workdir), str(s)) for s in (1, 4, 6)}
  leaves = {s: (jax.tree.leaves(r.params["backbone"]), jax.tree.leaves(r.params["att"])) for s, r in runs.items()}
  # Step 1's backbone is the initialisation (step 0 has LR 0 too), and step 4's is still the same.
  assert all(np.array_equal(a, b) for a, b in zip(leaves[1][0], leaves[4][0], strict=True))
  assert not all(np.array_equal(a, b) for a, b in zip(leaves[1][1], leaves[4][1], strict=True))
  assert not all(np.array_equal(a, b) for a, b in zip(leaves[4][0], leaves[6][0], strict=True))
  # Its BatchNorm statistics are frozen with it (the train step keeps them), then move.
  stats = {s: jax.tree.leaves(r.model_state["batch_stats"]["backbone"]) for s, r in runs.items()}
  assert all(np.array_equal(a, b) for a, b in zip(stats[1], stats[4], strict=True))
  assert not all(np.array_equal(a, b) for a, b in zip(stats[4], stats[6], strict=True))
  for a, b in zip(jax.tree.leaves(runs[6].model_state["bert"]), jax.tree.leaves(minilm[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["masked_tokens/count"] > 8 and 0 <= summary["masked_tokens/top1"] <= 100
