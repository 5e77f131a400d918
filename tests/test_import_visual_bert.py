"""The `visual_bert` import format against transformers' VisualBERT (an independent implementation): a tiny random
`VisualBertForPreTraining` saved with `save_pretrained`, imported as a user imports it (`vlrep.interop.import_run`
with no
options), loaded as users load runs (`vlrep.runs.load_run`, the method built from the run's config as
`vlrep.evaluate` builds it, nothing overridden) and run by vlrep on the same inputs; MMF's layout
(and torch's zip and legacy files) imports to the same parameters; bad inputs are clear errors; the imported run
starts a downstream run through `method.pretrained_run`; export (`vlrep.interop.export --format=visual_bert`) writes the
folder back bit for bit, writes a vlrep-trained VisualBERT that transformers loads and computes as vlrep does, and
refuses any other model.

Tolerance: 1e-5 relative (the largest absolute difference over the largest reference value) in float32. The two
implementations sum the embeddings in another order and reduce in other orders; the test prints the difference
it finds, well under the tolerance."""

import copy
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, run_main
from ml_collections import ConfigDict
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vlrep import methods, runs  # noqa: E402
from vlrep.interop import import_run  # noqa: E402
from vlrep.interop.formats import visual_bert  # noqa: E402
from vlrep.methods import vlbert  # noqa: E402
from vlrep.models import vl_bert  # noqa: E402

TOLERANCE = 1e-5
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]  # 40 tokens


def _tiny_config(**kw):
  sizes = dict(
    vocab_size=len(WORDS),
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=24,
    type_vocab_size=2,
    visual_embedding_dim=16,
    hidden_act="gelu",
    layer_norm_eps=1e-12,
  )
  return transformers.VisualBertConfig(**{**sizes, **kw})


def _randomise(model, seed=0):
  """Every parameter random (LayerNorm scales around 1): the defaults' zero biases, unit scales and visual tables
  copied from BERT's would hide a swapped or missed tensor."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g) * 0.2
      p.copy_(1.0 + noise if name.endswith("LayerNorm.weight") else noise)
  return model.eval()


def _write_vocab(folder, words=WORDS):
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "vocab.txt"), "w") as f:
    f.write("\n".join(words) + "\n")


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  return _randomise(transformers.VisualBertForPreTraining(_tiny_config()))


@pytest.fixture(scope="module")
def hf_folder(hf_model, tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("hf_visual_bert"))
  hf_model.save_pretrained(folder)  # config.json + model.safetensors (the tied decoder weight not stored)
  _write_vocab(folder)
  return folder


@pytest.fixture(scope="module")
def imported(hf_folder):
  return visual_bert.read(hf_folder)


@pytest.fixture(scope="module")
def imported_dir(hf_folder, tmp_path_factory):
  """The folder imported as the command imports it (`python -m vlrep.interop.import_run --format=visual_bert
  --checkpoint=FOLDER --workdir=RUN`: the format's default config, no options)."""
  workdir = str(tmp_path_factory.mktemp("imported") / "run")
  import_run.import_run("visual_bert", hf_folder, workdir)
  return workdir


def _inputs(seed=0, b=3, t=9, n=5):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, len(WORDS), size=(b, t))
  tokens[:, 0] = 2  # [CLS]
  lengths = [t, 6, 4]
  for i, length in enumerate(lengths):
    tokens[i, length - 1] = 3  # [SEP]
    tokens[i, length:] = 0  # [PAD]
  types = np.zeros((b, t), np.int64)
  types[0, 5:] = 1  # a second segment
  regions = rng.normal(size=(b, n, 16)).astype(np.float32)
  region_mask = np.ones((b, n), bool)
  region_mask[1, 3:] = False
  region_mask[2, 1:] = False
  return tokens, types, regions, region_mask


def _method(config, **method):
  """The run's method as `vlrep.evaluate` builds it (vlrep.methods.build of the config's method section), with
  `method` changed and nothing else: the run's own compute dtype."""
  c = copy.deepcopy(config)
  c.method.update(**method)
  return methods.build(c.method, len(WORDS))


def _vlrep_outputs(run, tokens, types, regions, region_mask):
  return _model_outputs(_method(run.config).model, run.params, tokens, types, regions, region_mask)


def _model_outputs(model, params, tokens, types, regions, region_mask):
  boxes = jnp.zeros(regions.shape[:2] + (4,))
  args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(types, jnp.int32), jnp.asarray(regions), boxes)
  variables = {"params": params}
  t, v, pooled, _ = model.apply(variables, *args, jnp.asarray(region_mask), method=vl_bert.VLBertModel.encode)
  seq = jnp.concatenate([t, v], axis=1)
  out = {"sequence": np.asarray(seq), "pooled": np.asarray(pooled)}
  out["mlm_logits"] = np.asarray(model.apply(variables, t, method=vl_bert.VLBertModel.mlm_logits))
  if "align_head" in params:
    out["alignment_logits"] = np.asarray(model.apply(variables, pooled, method=vl_bert.VLBertModel.alignment_logits))
  return out


def _reference_outputs(model, tokens, types, regions, region_mask, visual_type):
  with torch.no_grad():
    kw = dict(
      input_ids=torch.as_tensor(tokens),
      token_type_ids=torch.as_tensor(types),
      attention_mask=torch.as_tensor(tokens != 0).long(),
      visual_embeds=torch.as_tensor(regions),
      visual_attention_mask=torch.as_tensor(region_mask).long(),
      visual_token_type_ids=torch.full(region_mask.shape, visual_type, dtype=torch.long),
    )
    base = model.visual_bert(**kw)
    heads = model(**kw)
  return {
    "sequence": base.last_hidden_state.numpy(),
    "pooled": base.pooler_output.numpy(),
    "mlm_logits": heads.prediction_logits[:, : tokens.shape[1]].numpy(),
    # VisualBERT's (matching, random) -> vlrep's (not aligned, aligned)
    "alignment_logits": heads.seq_relationship_logits.numpy()[:, ::-1],
  }


def _relative(got, want):
  return float(np.abs(got - want).max() / np.abs(want).max())


def _assert_equal_to_reference(got, want, what):
  figures = {k: _relative(got[k], want[k]) for k in got}
  print(f"{what}: max relative difference vlrep vs transformers: {figures}")
  for k, rel in figures.items():
    assert rel <= TOLERANCE, (what, k, rel)
  return figures


# ---------------------------------------------------------------------------------------------------------
# Equivalence with transformers.
# ---------------------------------------------------------------------------------------------------------
def test_imported_visual_bert_computes_what_transformers_computes(hf_model, imported_dir):
  run = runs.load_run(imported_dir)  # exactly as imported: no override of its config
  tokens, types, regions, region_mask = _inputs()
  got = _vlrep_outputs(run, tokens, types, regions, region_mask)
  want = _reference_outputs(hf_model, tokens, types, regions, region_mask, visual_type=1)
  figures = _assert_equal_to_reference(got, want, "Hugging Face folder")
  assert max(figures.values()) > 0  # two implementations, not one
  # float32 is the importer's doing: the VisualBERT recipe (configs/vlbert.py, --config) trains in bfloat16.
  assert run.config.method.dtype == "float32" and run.meta["import"]["dtype"] == "float32"
  recipe = os.path.join(ROOT, "configs/vlbert.py") + ":arch=visual_bert,stage=pretrain"
  assert import_run.load_config(recipe).method.dtype == "bfloat16"
  # The check has teeth: vlrep's own region embeddings (box embedding, own LayerNorm, a segment vector) or the
  # other visual token type are not VisualBERT.
  other = _reference_outputs(hf_model, tokens, types, regions, region_mask, visual_type=0)
  assert _relative(got["sequence"], other["sequence"]) > 1e-2
  c = run.config
  assert (c.method.region_boxes, c.method.region_norm, c.method.region_type_embedding) == (False, "shared", "tables")
  assert c.method.region_type_id == 1 and c.method.visual.mode == "file" and c.method.visual.dim == 16
  assert c.method.task == "pretrain" and c.method.arch == "visual_bert" and c.method.alignment_weight == 1.0
  assert dict(c.method.bert_config)["num_attention_heads"] == 4 and run.model_state == {}
  assert "cls.predictions.decoder.weight" not in run.meta["import"]["dropped"]  # not stored: tied


def test_bfloat16_compute_only_when_asked(hf_model, hf_folder, tmp_path):
  """--dtype=bfloat16 gives a run that computes in bfloat16 (said in its note), off transformers by far more than
  float32 rounding (what the default would be without the importer's float32); another dtype is refused before
  anything is written."""
  import_run.import_run("visual_bert", hf_folder, str(tmp_path / "bf16"), dtype="bfloat16")
  run = runs.load_run(str(tmp_path / "bf16"))
  assert run.config.method.dtype == "bfloat16" and run.meta["import"]["dtype"].startswith("bfloat16 (--dtype")
  inputs = _inputs()
  got = _vlrep_outputs(run, *inputs)
  want = _reference_outputs(hf_model, *inputs, visual_type=1)
  figures = {k: _relative(got[k], want[k]) for k in got}
  print(f"--dtype=bfloat16: max relative difference vlrep vs transformers: {figures}")
  assert min(figures.values()) > 100 * TOLERANCE
  with pytest.raises(ValueError, match="--dtype='float16': an imported run computes in one of float32, bfloat16"):
    import_run.import_run("visual_bert", hf_folder, str(tmp_path / "f16"), dtype="float16")
  assert not (tmp_path / "f16").exists()


def test_region_embeddings_are_visual_berts_only_with_all_three_knobs(imported):
  """Each knob alone changes the model: VisualBERT's embeddings need all three (and vlrep's default builds the
  box embedding, the region LayerNorm and the segment vector)."""
  cfg = vlbert.bert_config_from_dict(dict(imported.config.method.bert_config), "test")
  tokens, types, regions, mask = (jnp.asarray(a) for a in _inputs())
  boxes = jnp.tile(jnp.array([0.1, 0.2, 0.5, 0.7]), regions.shape[:2] + (1,))
  default = vl_bert.VLBertModel(arch="visual_bert", bert=cfg, region_dim=16)
  names = set(default.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"]["regions_embed"])
  assert names == {"feature", "location", "segment", "LayerNorm"}
  exact = dict(region_boxes=False, region_norm="shared", region_type_embedding="tables")
  model = vl_bert.VLBertModel(arch="visual_bert", bert=cfg, region_dim=16, **exact)
  names = set(model.init(jax.random.PRNGKey(0), tokens, types, regions, boxes, mask)["params"]["regions_embed"])
  assert names == {"feature", "token_type_embeddings", "position_embeddings"}
  with pytest.raises(ValueError, match="region_type_id=2 is not a row of the 2 token types"):
    vl_bert.VLBertModel(arch="visual_bert", bert=cfg, region_dim=16, region_type_id=2, **exact).init(
      jax.random.PRNGKey(0), tokens, types, regions, boxes, mask
    )
  with pytest.raises(ValueError, match="ViLBERT's regions keep"):
    vl_bert.VLBertModel(arch="vilbert", bert=cfg, region_dim=16, v_hidden=32, bi_hidden=32, region_boxes=False).init(
      jax.random.PRNGKey(0), tokens, types, regions, boxes, mask
    )


# ---------------------------------------------------------------------------------------------------------
# MMF's layout and torch files.
# ---------------------------------------------------------------------------------------------------------
def _mmf_state_dict(hf_model):
  """The reference's tensors under the names MMF's VisualBERT saves (`VisualBERT.model` =
  VisualBERTForPretraining: `bert` = VisualBERTBase with BertVisioLinguisticEmbeddings, `cls` = BERT's heads)."""
  renames = {
    "embeddings.visual_projection.": "embeddings.projection.",
    "embeddings.visual_token_type_embeddings.": "embeddings.token_type_embeddings_visual.",
    "embeddings.visual_position_embeddings.": "embeddings.position_embeddings_visual.",
  }
  out = {}
  for key, value in hf_model.state_dict().items():
    if key.startswith("visual_bert."):
      key = key.removeprefix("visual_bert.")
      for old, new in renames.items():
        key = key.replace(old, new)
      key = "model.bert." + key
    else:
      key = "model." + key  # cls.predictions.*, cls.seq_relationship.*
    out[key] = value.clone()
  out["model.bert.embeddings.position_ids"] = torch.arange(24)[None]  # transformers 3's buffer, as MMF saves it
  return out


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_mmf_layout_imports_to_the_same_parameters_and_computes_mmfs_visual_bert(hf_model, imported, tmp_path):
  sd = _mmf_state_dict(hf_model)
  assert "model.bert.embeddings.token_type_embeddings_visual.weight" in sd
  _write_vocab(tmp_path)

  # A training checkpoint as MMF's Checkpoint.save writes it, in torch's legacy format (MMF's 2020 model zoo). (A
  # foreign object in it is refused, naming the file and the global: tests/test_safe_loading.py.)
  ckpt = {
    "model": sd,
    "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 5e-5, "params": [0]}]},
    "num_updates": 88000,
    "config": {"model_config": {"visual_bert": {"num_attention_heads": 4, "bert_model_name": "bert-base-uncased"}}},
  }
  torch.save(ckpt, tmp_path / "model.pth", _use_new_zipfile_serialization=False)
  run = visual_bert.read(str(tmp_path / "model.pth"))
  assert run.note["layout"] == "mmf" and run.config.method.region_type_id == 0  # MMF: visual_embeddings_type = 0
  assert "num_attention_heads" not in run.note.get("assumed", {})  # from the checkpoint's config; sizes: shapes
  mine, theirs = _flat(run.params), _flat({k: v for k, v in imported.params.items() if k != "align_head"})
  assert mine.keys() == theirs.keys()
  for k in mine:
    np.testing.assert_array_equal(mine[k], theirs[k], err_msg=k)
  # BERT's next-sentence head, untrained by MMF's MLM-only pretraining: dropped and said.
  assert "align_head" not in run.params and run.config.method.alignment_weight == 0.0
  assert "model.cls.seq_relationship.weight" in run.note["dropped"]
  assert "model.bert.embeddings.position_ids" in run.note["dropped"]
  assert "tied copy" in run.note["dropped"]["model.cls.predictions.decoder.weight"]
  tokens, types, regions, region_mask = _inputs(seed=1)
  got = _vlrep_outputs(run, tokens, types, regions, region_mask)
  want = _reference_outputs(hf_model, tokens, types, regions, region_mask, visual_type=0)
  want.pop("alignment_logits")
  _assert_equal_to_reference(got, want, "MMF layout")

  # The same tensors in a zip-format torch file, the bare state dict without a config: the same parameters, with
  # the unreadable head count assumed (BERT's 64-wide heads) and said, or given.
  torch.save(sd, tmp_path / "bare.pth")
  (tmp_path / "model.pth").unlink()
  bare = visual_bert.read(str(tmp_path / "bare.pth"), heads=4)
  for k, v in _flat(bare.params).items():
    np.testing.assert_array_equal(v, mine[k], err_msg=k)
  assumed = visual_bert.read(str(tmp_path / "bare.pth"))
  assert "num_attention_heads" in assumed.note["assumed"]
  assert dict(assumed.config.method.bert_config)["num_attention_heads"] == 1  # 32 // 64 -> at least one head


# ---------------------------------------------------------------------------------------------------------
# Bad inputs.
# ---------------------------------------------------------------------------------------------------------
def test_shape_mismatch_names_the_tensor_and_both_shapes(hf_folder, hf_model, tmp_path):
  folder = tmp_path / "hf"
  shutil.copytree(hf_folder, folder)
  raw = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**raw, "intermediate_size": 40}))
  with pytest.raises(ValueError) as e:
    visual_bert.read(str(folder))
  message = str(e.value)
  assert "visual_bert.encoder.layer.0.intermediate.dense.bias is (37,) in the checkpoint" in message
  assert "needs (40,)" in message
  # MMF's sizes are read from the tensors: one tensor of another size is named with both shapes.
  sd = _mmf_state_dict(hf_model)
  sd["model.bert.encoder.layer.1.attention.self.key.weight"] = torch.zeros(32, 30)
  _write_vocab(tmp_path / "mmf")
  torch.save(sd, tmp_path / "mmf" / "model.pth")
  with pytest.raises(ValueError, match=r"model\.bert\.encoder\.layer\.1\.attention\.self\.key\.weight is \(32, 30\) "
                     r"in the checkpoint, but .* needs \(32, 32\)"):  # fmt: skip
    visual_bert.read(str(tmp_path / "mmf" / "model.pth"), heads=4)


def test_vocabulary_of_another_size_and_missing_files_are_errors(hf_folder, tmp_path):
  _write_vocab(tmp_path / "small", WORDS[:-1])
  with pytest.raises(ValueError, match="has 39 tokens but the checkpoint's word embedding has 40 rows"):
    visual_bert.read(hf_folder, vocab=str(tmp_path / "small" / "vocab.txt"))
  folder = tmp_path / "novocab"
  shutil.copytree(hf_folder, folder)
  (folder / "vocab.txt").unlink()
  with pytest.raises(FileNotFoundError, match="Pass --vocab=PATH"):
    visual_bert.read(str(folder))
  assert visual_bert.read(str(folder), vocab=hf_folder).config.tokenizer.path == hf_folder
  (folder / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    visual_bert.read(str(folder))


def test_score_tells_visual_bert_checkpoints_from_others(hf_model):
  keys = set(hf_model.state_dict())
  assert visual_bert.score(keys) == (1.0, [], [])
  assert visual_bert.score(set(_mmf_state_dict(hf_model)))[0] == 1.0
  # A BERT (BertModel's names) is not a VisualBERT: what it lacks and what it has besides are named.
  bert_only = {k.removeprefix("visual_bert.") for k in keys if k.startswith("visual_bert.") and ".visual_" not in k}
  fraction, missing, unexpected = visual_bert.score(bert_only | {"encoder.layer.0.crossattention.self.query.weight"})
  assert fraction < 0.9 and missing == ["embeddings.visual_projection.weight", "embeddings.visual_projection.bias",
                                        "embeddings.visual_token_type_embeddings.weight",
                                        "embeddings.visual_position_embeddings.weight"]  # fmt: skip
  assert unexpected == ["encoder.layer.0.crossattention.self.query.weight"]


# ---------------------------------------------------------------------------------------------------------
# Downstream: pretrained_run.
# ---------------------------------------------------------------------------------------------------------
def _as_run(imported, path="/runs/imported", meta=None):
  return runs.Run(config=imported.config, params=imported.params, model_state={}, step=0, path=path, meta=meta or {})


def test_downstream_method_takes_the_imported_transformer_and_refuses_another_model(imported):
  down = dict(task="classify", loss="softmax", num_labels=3, pretrained_run="/runs/imported")
  method = _method(imported.config, **down)
  got = method.pretrained_variables({"pretrained_run": _as_run(imported)})
  assert set(got["params"]) == {"bert", "regions_embed", "mlm_head"}  # the alignment head is the pretraining's
  # vlrep's region embeddings downstream would not compute what the checkpoint computed: a clear error.
  vlrep_regions = _method(imported.config, **down, region_boxes=True, region_norm="own")
  with pytest.raises(ValueError, match="--config.method.region_boxes=False --config.method.region_norm=shared"):
    vlrep_regions.pretrained_variables({"pretrained_run": _as_run(imported)})
  # A BERT of the same shapes but other heads (which no shape shows) is refused too.
  other = dict(imported.config.method.bert_config, num_attention_heads=2)
  with pytest.raises(ValueError, match="num_attention_heads=4 there, 2 here"):
    _method(imported.config, **down, bert_config=other).pretrained_variables({"pretrained_run": _as_run(imported)})
  # Without a pretrained run, an architecture without weights would train from random weights.
  with pytest.raises(ValueError, match="without weights"):
    _method(imported.config).pretrained_variables({})


def test_visual_bert_tables_start_from_berts_when_bert_initialises_the_run():
  """VisualBERT's visual token-type and position tables start as copies of BERT's (MMF's
  initialize_visual_from_pretrained), through pretrained_variables."""
  from vlrep.config_utils import sibling_config

  c = sibling_config(os.path.join(ROOT, "configs", "vlbert.py"), "vlbert", "runlocal,arch=visual_bert,stage=pretrain")
  c.method.update(region_boxes=False, region_norm="shared", region_type_embedding="tables", bert_layers=1)
  method = vlbert.Method(c.method, 30522)
  got = method.pretrained_variables({})["params"]
  emb = got["bert"]["embeddings"]
  np.testing.assert_array_equal(
    got["regions_embed"]["token_type_embeddings"]["embedding"], emb["token_type_embeddings"]["embedding"]
  )
  np.testing.assert_array_equal(
    got["regions_embed"]["position_embeddings"]["embedding"], emb["position_embeddings"]["embedding"]
  )
  assert dataclasses.asdict(method.bert_config)["num_hidden_layers"] == 1


# ---------------------------------------------------------------------------------------------------------
# Export: the same key map read the other way (vlrep.interop.export --format=visual_bert).
# ---------------------------------------------------------------------------------------------------------
def _exportable(imported):
  """The imported run as vlrep.interop.export reads it from its directory (the import note in its metadata)."""
  return _as_run(imported, "/runs/imported/best/0", meta={"import": json.loads(json.dumps(imported.note))})


def _differing(want: dict, got: dict) -> list[str]:
  """The names of `want` that `got` lacks or holds otherwise: another dtype, shape or any bit."""
  same = lambda a, b: a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
  return [k for k in want if k not in got or not same(np.asarray(want[k]), np.asarray(got[k]))]


def _loads_cleanly(folder):
  model, info = transformers.VisualBertForPreTraining.from_pretrained(str(folder), output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
  return model.eval()


def test_export_round_trip_is_bit_exact_and_transformers_computes_the_same(hf_model, hf_folder, imported, tmp_path):
  out = tmp_path / "exported"
  info = visual_bert.write_folder(_exportable(imported), str(out))
  assert info["files"] == ["config.json", "model.safetensors", "vocab.txt"] and info["notes"] == []
  original, exported = (
    load_file(os.path.join(hf_folder, "model.safetensors")),
    load_file(str(out / "model.safetensors")),
  )
  assert _differing(original, exported) == []  # every tensor of the file: same name, dtype, shape and bits
  # Besides them, exactly the tied MLM decoder (which save_pretrained leaves out), as the model's own tensors.
  assert set(exported) - set(original) == set(visual_bert.tied("visual_bert.", "cls."))
  model_sd = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  assert set(exported) == set(model_sd) and _differing(model_sd, exported) == []
  # config.json: every field (the architecture and the folder's others) but the writer's version and dtype.
  want = json.loads(open(os.path.join(hf_folder, "config.json")).read())
  assert json.loads((out / "config.json").read_text()) == {
    k: v for k, v in want.items() if k not in ("transformers_version", "dtype")
  }
  assert (out / "vocab.txt").read_text() == open(os.path.join(hf_folder, "vocab.txt")).read()
  # transformers loads it (no missing or unexpected key) and computes exactly what the original computes.
  loaded = _loads_cleanly(out)
  inputs = _inputs(seed=2)
  want_out, got_out = (_reference_outputs(m, *inputs, visual_type=1) for m in (hf_model, loaded))
  for k in want_out:
    np.testing.assert_array_equal(got_out[k], want_out[k], err_msg=k)
  # Imported again: the run's parameters, bit for bit (the tied copies checked and dropped).
  again = visual_bert.read(str(out))
  assert _differing(_flat(imported.params), _flat(again.params)) == [] and again.config.method.region_type_id == 1
  # An existing folder is not replaced silently.
  with pytest.raises(FileExistsError, match="not empty; pass --overwrite"):
    visual_bert.write_folder(_exportable(imported), str(out))
  assert visual_bert.write_folder(_exportable(imported), str(out), overwrite=True)["keys"] == len(exported)


def test_the_round_trip_comparison_sees_a_transposed_kernel_and_unswapped_logits(hf_folder, imported, monkeypatch):
  """The bit-exact comparison has teeth: an exporter that wrote square Dense kernels untransposed (which no shape
  check sees) or the sentence-image logits in vlrep's order would fail it, on exactly those tensors."""
  from vlrep.interop.keymaps import TRANSFORMS

  original = load_file(os.path.join(hf_folder, "model.safetensors"))
  right, _ = visual_bert.state_dict(_exportable(imported))
  assert _differing(original, right) == []
  untransposed = lambda x, ctx: x if x.shape[0] == x.shape[1] else x.T
  monkeypatch.setitem(TRANSFORMS, "linear", (untransposed, TRANSFORMS["linear"][1]))
  monkeypatch.setitem(TRANSFORMS, "swap2", (lambda x, ctx: x, TRANSFORMS["swap2"][1]))
  wrong, _ = visual_bert.state_dict(_exportable(imported))
  differ = _differing(original, wrong)
  assert "visual_bert.encoder.layer.1.attention.self.query.weight" in differ and "cls.seq_relationship.bias" in differ
  assert "visual_bert.encoder.layer.1.intermediate.dense.weight" not in differ  # 37 x 32: transposed either way
  assert all(k.endswith((".weight", "seq_relationship.bias")) for k in differ)


def test_export_of_a_vlrep_trained_visual_bert_computes_its_outputs_in_transformers(tmp_path):
  """A configs/vlbert.py:arch=visual_bert run built with VisualBERT's embeddings (BERT from a folder, cut to its
  first layer, with another activation and LayerNorm eps; MMF's region type 0; no alignment head): transformers
  loads the export and computes vlrep's outputs."""
  from vlrep.config_utils import sibling_config
  from vlrep.models import bert as bert_lib
  from vlrep.runs import unflatten

  bert_dir = tmp_path / "bert"
  _write_vocab(bert_dir)
  sizes = dict(_tiny_config().to_dict(), hidden_act="gelu_new", layer_norm_eps=1e-7)
  fields = [f.name for f in dataclasses.fields(bert_lib.BertConfig)]
  (bert_dir / "config.json").write_text(json.dumps({"model_type": "bert", **{k: sizes[k] for k in fields}}))
  c = sibling_config(os.path.join(ROOT, "configs", "vlbert.py"), "vlbert",
                     f"arch=visual_bert,stage=pretrain,bert={bert_dir},regions={tmp_path}")  # fmt: skip
  knobs = dict(region_boxes=False, region_norm="shared", region_type_embedding="tables", region_type_id=0)
  c.method.update(bert_layers=1, dtype="float32", **knobs)
  c.method.visual.dim = 16
  cfg = bert_lib.BertConfig(**{k: sizes[k] for k in fields if k != "num_hidden_layers"}, num_hidden_layers=1)
  model = vl_bert.VLBertModel(arch="visual_bert", bert=cfg, region_dim=16, **knobs)
  shapes = visual_bert.expected_shapes(dict(dataclasses.asdict(cfg), visual_embedding_dim=16), 0, False)[0]
  rng = np.random.default_rng(4)  # every parameter random (LayerNorm scales around 1), as _randomise
  flat = {k: (k.endswith("scale") + 0.2 * rng.normal(size=v)).astype(np.float32) for k, v in shapes.items()}
  params = unflatten(flat)["params"]
  run = runs.Run(config=c, params=params, model_state={}, step=7, path=str(tmp_path / "run/best/7"), meta={})
  info = visual_bert.write_folder(run, str(tmp_path / "exported"))
  notes = " ".join(info["notes"])
  assert "visual_token_type_ids filled with 0" in notes and "written as zeros" in notes
  got_cfg = info["config"]
  assert (got_cfg["num_hidden_layers"], got_cfg["hidden_act"], got_cfg["layer_norm_eps"]) == (1, "gelu_new", 1e-7)
  assert got_cfg["pad_token_id"] == 0 and got_cfg["visual_embedding_dim"] == 16
  loaded = _loads_cleanly(tmp_path / "exported")
  inputs = _inputs(seed=3)
  want = _reference_outputs(loaded, *inputs, visual_type=0)
  assert not want.pop("alignment_logits").any()  # the zero head: logits 0
  _assert_equal_to_reference(_model_outputs(model, params, *inputs), want, "vlrep-trained run, exported")


def test_export_refuses_a_model_that_is_not_visual_berts(imported):
  from vlrep.config_utils import sibling_config

  flags = ("--config.method.region_boxes=False", "--config.method.region_norm=shared",
           "--config.method.region_type_embedding=tables", "--config.method.text_pool=cls")  # fmt: skip
  # vlrep's own region embeddings (box embedding, region LayerNorm, segment vector): why, and the flags.
  c = sibling_config(os.path.join(ROOT, "configs", "vlbert.py"), "vlbert", "arch=visual_bert,stage=pretrain")
  c.method.update(region_boxes=True, region_norm="own", region_type_embedding="segment", text_pool="cls")
  with pytest.raises(ValueError) as e:
    visual_bert.state_dict(runs.Run(c, imported.params, {}, 0, "/runs/vlrep_regions/best/0", {}))
  message = str(e.value)
  assert all(f in message for f in flags), message
  assert "region_boxes=True builds a box embedding" in message and "region_norm='own'" in message
  for change, match in (
    (dict(text_pool="mean"), r"text_pool='mean' builds a pooled output over the mean text state"),
    (dict(arch="vilbert"), "this run's arch is 'vilbert'"),
    (dict(name="virtex"), "this run's method is 'virtex'"),
  ):
    other = ConfigDict(imported.config.to_dict())
    other.method.update(change)
    with pytest.raises(ValueError, match=match):
      visual_bert.state_dict(runs.Run(other, imported.params, {}, 0, "/runs/other/best/0", {}))


# ---------------------------------------------------------------------------------------------------------
# The CLI end to end: import, then a downstream run from the imported run.
# ---------------------------------------------------------------------------------------------------------
def test_cli_import_then_downstream_run_loads_it_through_pretrained_run(tmp_path):

  from vlrep.data import region_files
  from vlrep.models import bert as bert_lib

  # MiniLM's sizes, one layer: what tests/tiny_vlbert.py's downstream run builds (bert=minilm, bert_layers=1).
  minilm = bert_lib.resolve_path("minilm")
  cfg = json.loads(open(os.path.join(minilm, "config.json")).read())
  sizes = {k: cfg[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size")}
  torch.manual_seed(1)
  model = _randomise(transformers.VisualBertForPreTraining(_tiny_config(**sizes, num_hidden_layers=1,
                                                                        max_position_embeddings=512)))  # fmt: skip
  folder = tmp_path / "hf"
  model.save_pretrained(folder)
  regions = tmp_path / "regions"
  regions.mkdir()
  rng = np.random.default_rng(0)
  for image_id in range(64):
    region_files.write_regions(str(regions / f"{image_id}.npz"), rng.normal(size=(3, 16)), [[0, 0, 16, 16]] * 3, 32, 32)
  # tests/tiny_vlbert.py with VisualBERT's region embeddings (the imported run's): a wrapper config, so the test does
  # not depend on which region-embedding defaults configs/vlbert.py chooses.
  wrapper = tmp_path / "tiny_visual_bert_exact.py"
  wrapper.write_text(
    f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\nimport tiny_vlbert\n\n\n"
    "def get_config(arg=None):\n  c = tiny_vlbert.get_config(arg)\n"
    "  c.method.update(region_boxes=False, region_norm='shared', region_type_embedding='tables', region_type_id=1)\n"
    "  return c\n"
  )
  run_dir = tmp_path / "imported"
  # What `python -m vlrep.interop.import_run` calls, in this process (the command's flags are run by the docs-commands
  # test).
  # The run keeps --config's data and evaluations (the tiny dataset and its region files).
  import_run.import_run(
    "visual_bert",
    str(folder),
    str(run_dir),
    vocab=os.path.join(minilm, "vocab.txt"),
    config=f"{wrapper}:arch=visual_bert,stage=pretrain,regions={regions}",
  )
  loaded = runs.load_run(str(run_dir))
  # The run keeps its vocabulary: its config names the copy in the run directory.
  assert loaded.config.method.bert_path == loaded.config.tokenizer.path == str(run_dir)
  assert open(run_dir / "vocab.txt").read() == open(os.path.join(minilm, "vocab.txt")).read()
  np.testing.assert_array_equal(
    loaded.params["regions_embed"]["feature"]["kernel"],
    model.visual_bert.embeddings.visual_projection.weight.detach().numpy().T,
  )
  # ... and the run on disk exports back (vlrep.interop.export): the folder's tensors, bit for bit.
  from vlrep.interop import export

  info = export.export(str(run_dir), "visual_bert", str(tmp_path / "exported"))
  assert info["files"] == ["config.json", "model.safetensors", "vocab.txt"]
  assert (
    _differing(load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "exported/model.safetensors")))
    == []
  )
  with pytest.raises(FileExistsError, match="--overwrite"):
    export.export(str(run_dir), "visual_bert", str(tmp_path / "exported"))
  # vlrep.evaluate on the imported run, with its own evaluations (the masked-token accuracy over the region files: a
  # VisualBERT run has no backbone, and evaluate builds backbone features only for evaluations that read them).
  from vlrep import evaluate

  metrics = evaluate.evaluate(ConfigDict({"evals": loaded.config.evals.to_dict()}), str(run_dir), checkpoint="latest")
  assert metrics["mlm/masked_tokens"] > 0 and 0 <= metrics["mlm/mlm_accuracy"] <= 100, metrics
  assert json.load(open(run_dir / "summary.json"))["mlm/mlm_accuracy"] == metrics["mlm/mlm_accuracy"]

  down = tmp_path / "ve"
  proc = run_main(
    down,
    "--config.method.visual.dim=16",
    f"--config.method.pretrained_run={run_dir}",
    config=f"{wrapper}:arch=visual_bert,stage=finetune,task=ve,frozen,regions={regions}",
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  end = runs.load_run(str(down), "latest")
  for name in ("bert", "regions_embed"):  # the frozen base is the imported one, bit for bit
    for a, b in zip(jax.tree.leaves(loaded.params[name]), jax.tree.leaves(end.params[name]), strict=True):
      np.testing.assert_array_equal(a, b)
