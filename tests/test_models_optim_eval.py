"""Model pieces, optimizer semantics and the VOC07 metric, checked against hand-computed values."""

import flax.linen
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from vlrep import optim
from vlrep.data import tokenizers
from vlrep.evaluators import voc07_svm
from vlrep.methods.virtex import reverse_captions
from vlrep.models import resnet, transformer


def test_reverse_captions_keeps_padding_in_place():
  s, e, p = tokenizers.SOS_ID, tokenizers.EOS_ID, tokenizers.PAD_ID
  tokens = jnp.array([[s, 10, 11, 12, e, p, p], [s, 20, e, p, p, p, p]])
  np.testing.assert_array_equal(reverse_captions(tokens), [[e, 12, 11, 10, s, p, p], [e, 20, s, p, p, p, p]])


def test_forward_head_is_causal():
  head = transformer.TransformerTextualHead(vocab_size=50, hidden=32, num_layers=2, max_len=8, directions=("forward",))
  visual = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 32))
  a = jnp.array([[2, 7, 8, 9, 10, 11]])
  b = a.at[0, 4:].set(30)  # change only the future tokens
  pad = {"forward": a == 0}
  params = head.init(jax.random.PRNGKey(1), visual, {"forward": a}, pad)
  la = head.apply(params, visual, {"forward": a}, pad)[0]["forward"]
  lb = head.apply(params, visual, {"forward": b}, pad)[0]["forward"]
  np.testing.assert_allclose(la[0, :4], lb[0, :4], atol=1e-5)
  assert not np.allclose(la[0, 4:], lb[0, 4:])


def _dropout_sites(layer, x, memory, mask):
  """The shapes of what each nn.Dropout of a decoder layer drops in a training step, in call order."""
  shapes = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, flax.linen.Dropout) and context.method_name == "__call__":
      shapes.append(tuple(args[0].shape))
    return next_fun(*args, **kwargs)

  variables = layer.init(jax.random.PRNGKey(0), x, memory, mask)
  with flax.linen.intercept_methods(record):
    layer.apply(variables, x, memory, mask, train=True, rngs={"dropout": jax.random.PRNGKey(1)})
  return shapes


def test_decoder_layer_drops_out_where_torchs_transformer_decoder_layer_does():
  # torch.nn.TransformerDecoderLayer (the official VirTex head), post-norm: dropout on the self-attention weights and
  # output, on the cross-attention weights and output, on the feed-forward's hidden activations
  # (linear2(dropout(gelu(linear1(x))))) and on its output: six sites. mlp_dropout=False skips the fifth.
  b, t, n, h, heads, f = 2, 5, 3, 16, 2, 40
  x, memory = jnp.ones((b, t, h)), jnp.ones((b, n, h))
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
  official = [(b, heads, t, t), (b, t, h), (b, heads, t, n), (b, t, h), (b, t, f), (b, t, h)]
  assert _dropout_sites(transformer.DecoderLayer(heads, f, 0.1, mlp_dropout=True), x, memory, mask) == official
  assert _dropout_sites(transformer.DecoderLayer(heads, f, 0.1), x, memory, mask) == official[:4] + official[5:]


def test_official_init_initialises_as_the_official_head():
  # kdexd/virtex's TransformerDecoderTextualHead: `_init_weights` draws every Linear / attention weight and embedding
  # N(0, 0.02) and zeroes the padding row, but leaves torch.nn.Linear's biases U(+-1/sqrt(fan_in)) (feed-forward,
  # visual projection, and the output layer made after it); torch's MultiheadAttention zeroes its own biases.
  from vlrep.models.virtex import VirTexModel

  hidden, std = 64, 0.05
  model = VirTexModel(
    vocab_size=300,
    backbone=dict(depth=10, width=8, stem="small", stem_stride=2),
    hidden=hidden,
    max_len=8,
    init_std=std,
    official_init=True,
  )
  tokens = jnp.ones((1, 8), jnp.int32)
  args = (
    jnp.zeros((1, 32, 32, 3)),
    {"forward": tokens, "backward": tokens},
    {"forward": tokens == 0, "backward": tokens == 0},
  )
  p = model.init(jax.random.PRNGKey(0), *args)["params"]
  head, layer = p["textual_head"], p["textual_head"]["forward_layer0"]
  words = np.asarray(head["embedding"]["words"]["embedding"])
  assert not words[0].any() and abs(words[1:].std() - std) < 0.1 * std
  for name, bias, fan_in in (
    ("output", head["output_bias"], hidden),
    ("mlp_in", layer["mlp_in"]["bias"], hidden),
    ("mlp_out", layer["mlp_out"]["bias"], 4 * hidden),
    ("visual_projection", p["visual_projection"]["bias"], 64),  # ResNet-10 w8: 64 features
  ):
    bound, bias = fan_in**-0.5, np.asarray(bias)
    assert np.abs(bias).max() <= bound and np.abs(bias).max() > 0.9 * bound, name  # uniform over the whole range
  assert abs(float(p["visual_projection"]["kernel"].std()) - std) < 0.1 * std  # not LeCun's 1/sqrt(64) = 0.125
  for attention in ("self_attention", "cross_attention"):
    assert not any(np.asarray(layer[attention][k]["bias"]).any() for k in ("query", "value", "out")), attention
  # Without the knob (configs saved before it): zero biases, LeCun visual projection, a non-zero padding row.
  q = VirTexModel(vocab_size=300, backbone=model.backbone, hidden=hidden, max_len=8, init_std=std).init(
    jax.random.PRNGKey(0), *args
  )["params"]
  assert (
    not np.asarray(q["textual_head"]["output_bias"]).any()
    and q["textual_head"]["embedding"]["words"]["embedding"][0].any()
  )


def test_grouped_batchnorm_uses_per_group_statistics():
  x = (
    jnp.concatenate([jnp.zeros((2, 1, 1, 1)), jnp.full((2, 1, 1, 1), 10.0)])
    + jnp.array([-1.0, 1, -1, 1])[:, None, None, None]
  )
  bn = resnet.GroupedBatchNorm(group_size=2)
  variables = bn.init(jax.random.PRNGKey(0), x, train=True)
  y, _ = bn.apply(variables, x, train=True, mutable=["batch_stats"])
  # Each group of 2 is normalised on its own: both groups map to (-1, 1).
  np.testing.assert_allclose(y.ravel(), [-1, 1, -1, 1], atol=1e-4)
  y_all, _ = resnet.GroupedBatchNorm(group_size=0).apply(variables, x, train=True, mutable=["batch_stats"])
  # One group over the whole batch [-1, 1, 9, 11]: mean 5, variance 26.
  np.testing.assert_allclose(y_all.ravel(), (np.array([-1, 1, 9, 11]) - 5) / np.sqrt(26), atol=1e-4)


def test_batchnorm_multiply_add_form_computes_the_plain_maths():
  """Training BatchNorm is applied as `x * a + b` (per-channel a = scale / std, b = bias - mean * a; 4% faster on an
  H200): its output, running statistics and gradients (input, scale and bias) equal the plain
  `(x - mean) / std * scale + bias` with per-group statistics, written out here."""
  groups_differ = jnp.arange(8.0)[:, None, None, None] // 4 * 5.0  # the second group of 4 is offset by 5
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 6, 6, 16)) * 3 + 1.5 + groups_differ
  residual = jax.random.normal(jax.random.PRNGKey(1), x.shape)
  weights = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
  bn = resnet.GroupedBatchNorm(group_size=4, momentum=0.5)
  variables = bn.init(jax.random.PRNGKey(2), x, True)
  params = jax.tree.map(lambda a: a + jax.random.uniform(jax.random.PRNGKey(3), a.shape), variables["params"])

  def plain(params, x):
    xg = x.reshape(2, 4, 6, 6, 16)
    mean, var = xg.mean((1, 2, 3), keepdims=True), xg.var((1, 2, 3), keepdims=True)
    y = ((xg - mean) / jnp.sqrt(var + 1e-5)).reshape(x.shape) * params["scale"] + params["bias"]
    stats = {"mean": 0.5 * mean.mean(0).ravel(), "var": 0.5 + 0.5 * var.mean(0).ravel() * 144 / 143}
    return jax.nn.relu(y + residual), stats

  def module(params, x):
    y, updates = bn.apply(
      {"params": params, "batch_stats": variables["batch_stats"]}, x, True, residual, True, mutable=["batch_stats"]
    )
    return y, updates["batch_stats"]

  (y, stats), (y_ref, stats_ref) = module(params, x), plain(params, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for key in ("mean", "var"):
    np.testing.assert_allclose(stats[key], stats_ref[key], rtol=1e-5)
  grads = jax.grad(lambda p, x: (module(p, x)[0] * weights).sum(), argnums=(0, 1))(params, x)
  grads_ref = jax.grad(lambda p, x: (plain(p, x)[0] * weights).sum(), argnums=(0, 1))(params, x)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.abs(b).max()))


def test_resnet50_shapes_and_parameter_count():
  model = resnet.ResNet(depth=50)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3))))
  n = sum(np.prod(x.shape) for x in jax.tree.leaves(variables["params"]))
  assert n == 23_508_032  # torchvision resnet50 without the fc layer
  out = jax.eval_shape(lambda v: model.apply(v, jnp.zeros((2, 224, 224, 3))), variables)
  assert out[0].shape == (2, 7, 7, 2048) and out[1]["pre_logits"].shape == (2, 2048)


def test_zero_init_last_bn_starts_every_block_as_the_identity():
  import functools

  from flax import linen as nn

  norm = functools.partial(resnet.GroupedBatchNorm, group_size=0)
  conv = functools.partial(nn.Conv, use_bias=False)
  for block, channels in ((resnet.BasicBlock(8, 1, norm, conv, zero_init_last_bn=True), 8),
                          (resnet.Bottleneck(4, 1, norm, conv, zero_init_last_bn=True), 16)):  # fmt: skip
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, channels))
    variables = block.init(jax.random.PRNGKey(1), x, train=False)
    # The residual branch starts at exactly 0, so the block is relu(input) (torchvision's zero_init_residual).
    np.testing.assert_array_equal(block.apply(variables, x, train=False), nn.relu(x))
    plain = block.clone(zero_init_last_bn=False)
    assert not np.allclose(plain.apply(plain.init(jax.random.PRNGKey(1), x, train=False), x, train=False), nn.relu(x))
  # The whole network passes it to every block: the last BN of each has scale 0, the others 1.
  params = resnet.ResNet(depth=26, width=8, zero_init_last_bn=True).init(jax.random.PRNGKey(0), x[..., :3])["params"]
  for name, p in params.items():
    if name.startswith("layer"):
      assert not np.asarray(p["bn3"]["scale"]).any() and np.asarray(p["bn1"]["scale"]).all()


def test_small_stem_keeps_resolution_and_the_imagenet_stem_is_unchanged():
  x = jnp.zeros((2, 64, 64, 3))
  grids = {}
  for stem, stride in (("imagenet", 2), ("small", 2), ("small", 1)):
    model = resnet.ResNet(depth=10, width=8, stem=stem, stem_stride=stride)
    variables = jax.eval_shape(lambda m=model: m.init(jax.random.PRNGKey(0), x))
    out, aux = jax.eval_shape(lambda v, m=model: m.apply(v, x), variables)
    grids[(stem, stride)] = (aux["stage1"].shape[1], out.shape[1])
    kernel = variables["params"]["conv1"]["kernel"].shape
    assert kernel == ((7, 7, 3, 8) if stem == "imagenet" else (3, 3, 3, 8))
    assert aux["pre_logits"].shape == (2, 64)
  # The ImageNet stem downsamples 4x before the first stage, the small stem its stride only.
  assert grids == {("imagenet", 2): (16, 2), ("small", 2): (32, 4), ("small", 1): (64, 8)}
  with pytest.raises(ValueError, match="Unknown ResNet stem"):
    resnet.ResNet(depth=10, width=8, stem="cifar").init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="stem_stride must be 1 or 2"):
    resnet.ResNet(depth=10, width=8, stem="small", stem_stride=4).init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="applies to stem='small'"):
    resnet.ResNet(depth=10, width=8, stem_stride=1).init(jax.random.PRNGKey(0), x)


def test_lookahead_syncs_every_k_steps():
  params = {"w": jnp.array(1.0)}
  tx = optim.lookahead(optax.sgd(0.1), sync_period=2, alpha=0.5)
  state = tx.init(params)
  grads = {"w": jnp.array(1.0)}
  u, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, u)
  assert np.isclose(params["w"], 0.9)  # fast step
  u, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, u)
  # fast would be 0.8; sync: slow = 1 + 0.5 * (0.8 - 1) = 0.9, and fast is reset to slow.
  assert np.isclose(params["w"], 0.9) and np.isclose(state.slow["w"], 0.9)


def test_param_groups_and_no_decay():
  params = {
    "backbone": {"conv1": {"kernel": jnp.ones(2)}},
    "textual_head": {"ln_self": {"scale": jnp.ones(2)}, "mlp_in": {"kernel": jnp.ones(2)}},
  }
  cfg = ml_collections.ConfigDict(
    dict(
      name="sgd",
      momentum=0.0,
      nesterov=False,
      weight_decay=0.5,
      grad_clip_norm=0.0,
      lookahead_steps=0,
      lookahead_alpha=0.5,
      lr_groups=(("^backbone/", 1.0), (".*", 0.1)),
      no_decay=r"^textual_head/(.*/)?(bias|ln[^/]*/scale)$",
    )
  )
  tx, _ = optim.build(cfg, params, total_steps=10, warmup_steps=0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  assert np.allclose(updates["backbone"]["conv1"]["kernel"], -0.5)  # lr 1.0 * decay 0.5
  assert np.allclose(updates["textual_head"]["mlp_in"]["kernel"], -0.05)  # lr 0.1 * decay 0.5
  assert np.allclose(updates["textual_head"]["ln_self"]["scale"], 0.0)  # no decay
  with pytest.raises(ValueError, match="matches none"):
    optim.group_labels(params, (("^backbone/", 1.0),))


def test_voc07_ap_and_svm_protocol():
  # Perfect ranking -> 1; the classic 11-point value for a known ranking.
  assert np.isclose(voc07_svm.voc07_ap(np.array([3.0, 2, 1]), np.array([1, 1, -1])), 1.0)
  ap = voc07_svm.voc07_ap(np.array([4.0, 3, 2, 1]), np.array([-1, 1, -1, 1]))
  # precision at recall 0.5 is 0.5, at recall 1 it is 0.5 -> all 11 points 0.5
  assert np.isclose(ap, 0.5)
  rng = np.random.default_rng(0)
  labels = np.where(rng.random((300, 3)) < 0.3, 1, -1)
  informative = labels + 0.3 * rng.normal(size=labels.shape)
  noise = rng.normal(size=(300, 8))
  good = voc07_svm.fit_and_score(
    np.c_[informative, noise][:200], labels[:200], np.c_[informative, noise][200:], labels[200:]
  )
  bad = voc07_svm.fit_and_score(noise[:200], labels[:200], noise[200:], labels[200:])
  assert good["map"] > 95 and bad["map"] < 50


@pytest.mark.parametrize("task", ["bicaptioning", "captioning", "token_classification", "masked_lm"])
def test_every_task_gives_finite_loss_and_gradients_in_bfloat16(task):
  from conftest import load_tiny_config

  from vlrep import methods

  cfg = load_tiny_config(f"task={task}").method
  cfg.dtype = "bfloat16"
  method = methods.build(cfg, vocab_size=60)
  rng = np.random.default_rng(0)
  tokens = np.zeros((8, 12), np.int32)
  for i in range(8):
    n = 3 + i
    tokens[i, :n] = [tokenizers.SOS_ID, *rng.integers(5, 60, n - 2), tokenizers.EOS_ID]
  batch = {
    "image": jnp.asarray(rng.normal(size=(8, 32, 32, 3)), jnp.float32),
    "tokens": jnp.asarray(tokens),
    "stat_empty": jnp.zeros((8,), bool),
  }
  variables = jax.jit(method.init)(jax.random.PRNGKey(0), batch)  # jitted: eager bf16 on CPU is slow
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables["params"]))  # params stay f32

  def loss_fn(params):
    return method.loss({**variables, "params": params}, batch, jax.random.PRNGKey(1), True)[0]

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(variables["params"])
  assert np.isfinite(float(loss)) and float(loss) > 0
  # Untrained model: loss near log(vocab) per predicted token (x2 directions for bicaptioning).
  expected = np.log(60) * (2 if task == "bicaptioning" else 1)
  assert 0.5 * expected < float(loss) < 2 * expected, (task, float(loss))
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))
  assert float(jnp.abs(grads["backbone"]["conv1"]["kernel"]).sum()) > 0  # text supervision reaches the backbone


def test_masked_lm_masks_as_bert_80_10_10():
  from vlrep.methods.virtex import mask_tokens

  rng = np.random.default_rng(0)
  tokens = np.zeros((400, 40), np.int32)
  tokens[:, 0], tokens[:, 1:-1], tokens[:, -1] = tokenizers.SOS_ID, rng.integers(5, 256, (400, 38)), tokenizers.EOS_ID
  tokens[:100, 20:] = tokenizers.PAD_ID  # padded captions: padding is never picked
  inputs, picked = (np.asarray(x) for x in mask_tokens(jnp.asarray(tokens), jax.random.PRNGKey(0), 0.15, 0.8, 0.1, 256))
  special = tokens < tokenizers.NUM_SPECIAL
  assert not picked[special].any() and picked.any(axis=1).all()
  np.testing.assert_array_equal(inputs[~picked], tokens[~picked])  # unpicked tokens are untouched
  assert abs(picked.sum() / (~special).sum() - 0.15) < 0.01
  as_mask = inputs[picked] == tokenizers.MASK_ID
  kept = inputs[picked] == tokens[picked]
  random = ~as_mask & ~kept
  assert abs(as_mask.mean() - 0.8) < 0.02 and abs(random.mean() - 0.1) < 0.015
  # A random replacement equals the original 1 time in 251, so "kept" is 10% plus that share of 10%.
  assert abs(kept.mean() - 0.1 * (1 + 1 / 251)) < 0.015
  assert (inputs[picked][random] >= tokenizers.NUM_SPECIAL).all() and (inputs < 256).all()
  only_mask, _ = mask_tokens(jnp.asarray(tokens), jax.random.PRNGKey(0), 0.15, 1.0, 0.0, 256)
  assert (np.asarray(only_mask)[picked] == tokenizers.MASK_ID).all()
