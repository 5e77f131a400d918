"""config.remat (vlrep.models.remat): each ResNet residual block and each transformer layer is one jax.checkpoint
under the named policy; gradients, BatchNorm statistics and the parameter tree are those without it, and the
compiled backward pass keeps less.

CPU note: XLA's CPU pipeline expands the optimisation barriers that keep a checkpoint's recomputation apart
(`cse_barrier_expander`), after which common-subexpression elimination merges the recomputation back into the
forward pass: on a CPU, rematerialisation saves no memory and the compiled figures of every policy are alike.
The memory figures here are compiled with that pass off (`NO_BARRIER_EXPANSION`): the program with the barriers
jax.checkpoint emits kept (what an accelerator's compiler receives; not measured on one here, no device was lent).
"""

import os
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_clip  # noqa: E402
import tiny_virtex  # noqa: E402

from vlrep import methods  # noqa: E402
from vlrep.models import bert as bert_lib  # noqa: E402
from vlrep.models import icmlm, loctex, mct, remat, resnet, special_tokens, vl_bert  # noqa: E402

NO_BARRIER_EXPANSION = {"xla_disable_hlo_passes": "cse_barrier_expander"}
BATCH = 32  # large enough that activations, not parameters, fill the backward pass's temporaries
VOCAB = 200


def _batch(b: int, t: int = 12, seed: int = 0) -> dict:
  r = np.random.RandomState(seed)
  tokens = np.zeros((b, t), np.int32)
  for i, n in enumerate(r.randint(3, t - 1, b)):
    tokens[i, 0], tokens[i, n] = special_tokens.SOS_ID, special_tokens.EOS_ID
    tokens[i, 1:n] = r.randint(special_tokens.NUM_SPECIAL, VOCAB, n - 1)
  return {"image": jnp.asarray(r.randn(b, 32, 32, 3).astype(np.float32)), "tokens": jnp.asarray(tokens)}


def _checkpoints(jaxpr) -> list:
  """The policies of every jax.checkpoint in a jaxpr, nested ones (inside jit, scan) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("checkpoint", "remat2"):
      found.append(eqn.params["policy"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _checkpoints(sub)
  return found


def _run(module, name: str) -> dict:
  """One tiny config with `remat=name`: its variables, and the loss, gradients and new BatchNorm statistics of one
  training loss (dropout on) at BATCH, from the backward pass compiled with jax.checkpoint's barriers kept."""
  config = module.get_config()
  config.remat = name
  method = methods.build(methods.method_config(config), VOCAB)
  batch = _batch(BATCH)
  variables = method.init(jax.random.PRNGKey(0), _batch(8, seed=1))

  def loss(params, batch):
    value, _, state = method.loss({**variables, "params": params}, batch, jax.random.PRNGKey(3), True)
    return value, state

  grad = jax.value_and_grad(loss, has_aux=True)
  compiled = jax.jit(grad).lower(variables["params"], batch).compile(compiler_options=NO_BARRIER_EXPANSION)
  (value, state), grads = compiled(variables["params"], batch)
  return {
    "variables": variables,
    "loss": value,
    "grads": grads,
    "state": state,
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    "checkpoints": _checkpoints(jax.make_jaxpr(loss)(variables["params"], batch).jaxpr),
  }


@pytest.fixture(scope="module", params=["tiny_virtex", "tiny_clip"])
def runs(request):
  module = {"tiny_virtex": tiny_virtex, "tiny_clip": tiny_clip}[request.param]
  return request.param, {name: _run(module, name) for name in remat.POLICIES}


def _largest_difference(a, b) -> float:
  """The largest |a - b| over the trees, relative to the largest |b| of the same leaf."""
  diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / max(float(jnp.max(jnp.abs(y))), 1e-30)), a, b)
  return max(jax.tree.leaves(diffs))


def test_every_policy_gives_the_same_gradients_statistics_and_parameter_tree(runs):
  model, by_policy = runs
  none = by_policy["none"]
  # Blocks in the tiny configs: 4 residual blocks (depth 10) and one transformer layer per textual direction.
  blocks = {"tiny_virtex": 4 + 2, "tiny_clip": 4 + 1}[model]
  assert none["checkpoints"] == []
  for name in ("dots", "full"):
    run = by_policy[name]
    assert run["checkpoints"] == [remat.POLICIES[name]] * blocks, (model, name)
    shapes = lambda tree: jax.tree_util.tree_map_with_path(lambda path, x: (jax.tree_util.keystr(path), x.shape), tree)
    assert shapes(run["variables"]) == shapes(none["variables"])  # the same paths and shapes: checkpoints load
    # Float32 rounding, measured (largest difference over each leaf's largest gradient): VirTex 1e-6, CLIP 1.5e-5
    # under the tests' XLA flags (conftest: LLVM -O0, no fusion emitters; 1.6e-7 under the default flags), where
    # the forward's fusions already round differently (loss 1 ulp apart, BatchNorm statistics 2e-7) and the
    # contrastive loss's scale of 14 amplifies it. VirTex trains with dropout: its equal gradients also mean equal
    # dropout masks inside the checkpoints.
    assert float(run["loss"]) == pytest.approx(float(none["loss"]), rel=1e-6)
    assert _largest_difference(run["grads"], none["grads"]) < 1e-4, (model, name)
    assert jax.tree_util.tree_structure(run["state"]) == jax.tree_util.tree_structure(none["state"])
    # BatchNorm statistics update inside the checkpoints, as without them (and they did move).
    assert _largest_difference(run["state"], none["state"]) < 1e-5, (model, name)
    assert _largest_difference(run["state"]["batch_stats"], none["variables"]["batch_stats"]) > 1e-3


def test_rematerialisation_keeps_less_for_the_backward_pass(runs):
  model, by_policy = runs
  temp = {name: run["temp_bytes"] for name, run in by_policy.items()}
  # Measured at BATCH=32 (bytes, tests' XLA flags): VirTex none 10.1M, dots 8.1M, full 6.5M; CLIP none 4.03M, dots
  # 3.76M, full 3.35M.
  assert temp["full"] < temp["dots"] < temp["none"], (model, temp)


def test_an_unknown_policy_is_refused_with_the_choices():
  with pytest.raises(ValueError, match="'none', 'dots', 'full'"):
    remat.check("everything")
  net = resnet.ResNet(depth=10, width=8, remat="all")
  with pytest.raises(ValueError, match="Unknown remat policy 'all'"):
    jax.eval_shape(net.init, jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))


def _trees_alike(make, *args, **kwargs):
  """make(remat) -> a module; its variables' paths and shapes under each policy, and a training gradient traced
  (not compiled) under 'full': the wrapped blocks take their static flags where the callers pass them."""
  shapes = {}
  for name in remat.POLICIES:
    module = make(name)
    variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), *args, **kwargs)
    shapes[name] = jax.tree_util.tree_map_with_path(lambda path, x: (jax.tree_util.keystr(path), x.shape), variables)
  assert shapes["dots"] == shapes["none"] and shapes["full"] == shapes["none"]
  return shapes["none"]


def test_the_other_models_keep_their_parameter_trees():
  images, tokens = _batch(2)["image"], _batch(2)["tokens"]
  backbone = dict(depth=10, width=8)
  text = dict(hidden=32, num_layers=1, num_heads=2, max_len=40)
  _trees_alike(lambda r: loctex.LocTexModel(VOCAB, backbone, text, embed_dim=16, remat=r), images, tokens)
  _trees_alike(lambda r: mct.MCTModel(VOCAB, backbone, text, head_hidden=16, remat=r), images, tokens)
  small_bert = bert_lib.BertConfig(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
  )
  words = jnp.zeros((2, 12, 32))
  for variant in ("tfm", "att_fc"):
    _trees_alike(
      lambda r, variant=variant: icmlm.ICMLMModel(
        variant, backbone, small_bert, num_tags=5, tfm_heads=2, tfm_mlp_dim=64, att_dim=16, remat=r
      ),
      images,
      words,
      tokens != 0,
      jnp.zeros((2,), jnp.int32),
      jnp.zeros((VOCAB, 32)),
    )
  regions, boxes, mask = _regions()
  for arch in vl_bert.ARCHS:
    tree = _trees_alike(
      lambda r, arch=arch: vl_bert.VLBertModel(
        arch,
        small_bert,
        v_layers=1,
        v_hidden=16,
        v_heads=2,
        v_intermediate=32,
        bi_hidden=16,
        bi_heads=2,
        region_dim=16,
        remat=r,
      ),
      tokens,
      jnp.zeros_like(tokens),
      regions,
      boxes,
      mask,
    )
    assert "layer_1" in tree["params"]["bert"]


@pytest.mark.parametrize("name", ["dots", "full"])
def test_wrapped_bert_and_co_attention_layers_train(name):
  """A training gradient traced through ViLBERT (dropout on: `deterministic` is a static argument of the wrapped
  BERT layers, visual layers and co-attention blocks): one checkpoint per block, and the gradient's trace holds
  the recomputation."""
  cfg = bert_lib.BertConfig(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
  )
  model = vl_bert.VLBertModel(
    "vilbert", cfg, v_layers=1, v_hidden=16, v_heads=2, v_intermediate=32, bi_hidden=16, bi_heads=2, remat=name
  )
  tokens = _batch(2)["tokens"]
  regions, boxes, mask = _regions()
  args = (tokens, jnp.zeros_like(tokens), regions, boxes, mask)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), *args)["params"]

  def loss(params):
    t, v, pooled, _ = model.apply(
      {"params": params}, *args, False, method=vl_bert.VLBertModel.encode, rngs={"dropout": jax.random.PRNGKey(1)}
    )
    return jnp.sum(t**2) + jnp.sum(v**2) + jnp.sum(pooled)

  assert _checkpoints(jax.make_jaxpr(loss)(params).jaxpr) == [remat.POLICIES[name]] * 4  # 2 text, 1 visual, 1 co
  grads = jax.eval_shape(jax.grad(loss), params)
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)


def _regions(b: int = 2, n: int = 3, d: int = 16):
  boxes = jnp.tile(jnp.array([0.1, 0.1, 0.5, 0.5]), (b, n, 1))
  return jnp.ones((b, n, d)), boxes, jnp.ones((b, n), bool)
