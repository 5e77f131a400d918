"""Every speed switch keeps the maths: the switched path's losses, gradients and parameters match the plain path's
to float tolerance (docs/speed.md lists the switches and what each one moved on an accelerator)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vlrep import optim, train_step


class QuadraticMethod:
  """A two-group least-squares model behind the method contract: enough to drive the real train step."""

  fields = ("x", "y")

  def init(self, rng, batch):
    a, b = jax.random.split(rng)
    return {
      "params": {
        "backbone": {"conv": {"kernel": jax.random.normal(a, (6, 4))}},
        "textual_head": {"ln": {"scale": jnp.ones(4)}, "out": {"kernel": jax.random.normal(b, (4, 3))}},
      }
    }

  def loss(self, variables, batch, rng, train=True):
    p = variables["params"]
    h = batch["x"] @ p["backbone"]["conv"]["kernel"] * p["textual_head"]["ln"]["scale"]
    pred = h @ p["textual_head"]["out"]["kernel"]
    return jnp.mean((pred - batch["y"]) ** 2), {}, {}


def sgd_config(**switches) -> ml_collections.ConfigDict:
  defaults = dict(grad_norm_once=False, lookahead_sync_only=False, flat_update=False, nesterov=False)
  return ml_collections.ConfigDict(
    dict(
      name="sgd",
      momentum=0.9,
      weight_decay=1e-2,
      grad_clip_norm=10.0,  # the gradients start far above it and fall below it: both branches run
      lookahead_steps=3,
      lookahead_alpha=0.5,
      lr_groups=(("^backbone/", 0.05), (".*", 0.02)),
      no_decay=r"^textual_head/(.*/)?(bias|ln[^/]*/scale)$",
      **{**defaults, **switches},
    )
  )


def trajectory(config, steps=8):
  """Parameters and metrics after each of `steps` real train steps (warmup 2, cosine over 10)."""
  method = QuadraticMethod()
  rng = np.random.default_rng(0)
  batch = {"x": jnp.asarray(rng.normal(size=(16, 6)) * 0.5, jnp.float32)}
  batch["y"] = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
  key = jax.random.PRNGKey(0)
  params = method.init(key, batch)["params"]
  tx, schedules = optim.build(config, params, total_steps=10, warmup_steps=2)
  state = train_step.init_train_state(method, tx, key, batch)
  step = jax.jit(train_step.make_train_step(method, tx, schedules, key, optim.step_clip_norm(config)))
  out = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    out.append((state["params"], metrics["train/loss"], metrics["train/grad_norm"]))
  return out


@pytest.mark.parametrize(
  "switches",
  [
    dict(grad_norm_once=True),
    dict(lookahead_sync_only=True),
    dict(flat_update=True),
    dict(flat_update=True, nesterov=True),
    dict(grad_norm_once=True, lookahead_sync_only=True, flat_update=True),
  ],
  ids=lambda s: "+".join(f"{k}={v}" for k, v in s.items()),
)
def test_optimizer_switches_follow_the_plain_trajectory(switches):
  plain_switches = {k: v for k, v in switches.items() if k == "nesterov"}
  plain, fast = trajectory(sgd_config(**plain_switches)), trajectory(sgd_config(**switches))
  norms = [float(n) for _, _, n in plain]
  assert max(norms) > 10.0 > min(norms), norms  # clipping acted on some steps and not on others
  for (p_plain, loss_plain, norm_plain), (p_fast, loss_fast, norm_fast) in zip(plain, fast, strict=True):
    np.testing.assert_allclose(loss_fast, loss_plain, rtol=1e-5)
    np.testing.assert_allclose(norm_fast, norm_plain, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p_fast, p_plain)
  # The parameters moved (a switch that froze them would match a frozen plain path only by accident).
  first, last = plain[0][0], plain[-1][0]
  assert float(jnp.abs(first["backbone"]["conv"]["kernel"] - last["backbone"]["conv"]["kernel"]).max()) > 1e-2


def test_grad_norm_once_moves_the_clip_out_of_the_optimizer():
  config = sgd_config(grad_norm_once=True)
  assert optim.step_clip_norm(config) == 10.0 and optim.step_clip_norm(sgd_config()) == 0.0
  params = {"backbone": {"w": jnp.ones(2)}, "textual_head": {"b": jnp.ones(2)}}
  tx, _ = optim.build(config, params, 10, 0)
  # Without the step's clip, the optimizer's update is unclipped: a huge gradient gives a huge step.
  huge = jax.tree.map(lambda p: 1e6 * jnp.ones_like(p), params)
  updates, _ = tx.update(huge, tx.init(params), params)
  assert float(jnp.abs(updates["backbone"]["w"]).max()) > 1e3


def test_flat_update_refuses_adamw():
  config = sgd_config(flat_update=True)
  config.name = "adamw"
  with pytest.raises(ValueError, match="flat_update implements SGD only"):
    optim.build(config, {"backbone": {"w": jnp.ones(2)}}, 10, 0)


def virtex_loss_and_grads(method_overrides: dict, params=None, batch_size=8, rng_impl=None):
  """(loss, gradients, params) of a tiny bicaptioning VirTex (2 layers, dropout on) in float32 on fixed inputs."""
  from conftest import load_tiny_config

  from vlrep import methods

  cfg = load_tiny_config("").method
  cfg.update(num_layers=2, dtype="float32", **method_overrides)
  method = methods.build(cfg, vocab_size=60)
  rng = np.random.default_rng(0)
  tokens = np.zeros((batch_size, 12), np.int32)
  for i in range(batch_size):
    n = 3 + i % 9
    tokens[i, :n] = [2, *rng.integers(5, 60, n - 2), 3]
  batch = {"image": jnp.asarray(rng.normal(size=(batch_size, 32, 32, 3)), jnp.float32), "tokens": jnp.asarray(tokens)}
  key = jax.random.PRNGKey(1)
  variables = method.init(key, batch)
  if params is not None:
    variables = {**variables, "params": params}

  def loss(p):
    return method.loss({**variables, "params": p}, batch, key, True)[0]

  value, grads = jax.value_and_grad(loss)(variables["params"])
  return value, grads, variables["params"]


def assert_trees_close(a, b, scaled_atol=1e-5):
  """Leaf by leaf: rtol 1e-4, and an absolute tolerance of `scaled_atol` times the leaf's largest magnitude
  (a sum that cancels to ~0 carries the rounding of its large terms)."""

  def close(x, y):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=scaled_atol * float(np.abs(np.asarray(y)).max()) + 1e-12)

  jax.tree.map(close, a, b)


@pytest.mark.parametrize("switches", [dict(fused_qkv=True), dict(fused_memory_kv=True)], ids=str)
def test_fused_head_projections_match_the_plain_head(switches):
  loss_plain, grads_plain, params = virtex_loss_and_grads({})
  loss_fused, grads_fused, fused_params = virtex_loss_and_grads(switches)
  # The parameters keep their names and shapes (and values: the same initialisation), so checkpoints carry over.
  jax.tree.map(np.testing.assert_array_equal, fused_params, params)
  np.testing.assert_allclose(loss_fused, loss_plain, rtol=1e-5)
  assert_trees_close(grads_fused, grads_plain)
  head = grads_fused["textual_head"]
  for name in ("forward_layer1", "backward_layer0"):
    assert float(jnp.abs(head[name]["cross_attention"]["key"]["kernel"]).max()) > 0  # the fused kernels learn
    assert float(jnp.abs(head[name]["self_attention"]["query"]["kernel"]).max()) > 0


def test_padded_vocabulary_matches_the_plain_head():
  loss_padded, grads_padded, padded = virtex_loss_and_grads(dict(vocab_multiple=128))
  head = padded["textual_head"]
  assert head["embedding"]["words"]["embedding"].shape[0] == 128 and head["output_bias"].shape == (128,)

  def cut(tree):  # the plain head's parameters: the padded tables' first 60 rows
    tree = jax.tree.map(lambda x: x, tree)
    tree["textual_head"]["embedding"]["words"]["embedding"] = tree["textual_head"]["embedding"]["words"]["embedding"][
      :60
    ]
    tree["textual_head"]["output_bias"] = tree["textual_head"]["output_bias"][:60]
    return tree

  loss_plain, grads_plain, _ = virtex_loss_and_grads({}, params=cut(padded))
  np.testing.assert_allclose(loss_padded, loss_plain, rtol=1e-5)
  assert_trees_close(cut(grads_padded), grads_plain)
  # The padding rows take no gradient: no token looks them up and their logits are cut off.
  assert float(jnp.abs(grads_padded["textual_head"]["embedding"]["words"]["embedding"][60:]).max()) == 0.0
  assert float(jnp.abs(grads_padded["textual_head"]["output_bias"][60:]).max()) == 0.0


def resnet_outputs(depth, stem, group_size, size=32, **switches):
  """Output, loss, gradients and new BatchNorm statistics of a small ResNet in training mode (float32)."""
  from vlrep.models import resnet

  model = resnet.ResNet(depth=depth, width=8, bn_group_size=group_size, stem=stem, **switches)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, size, size, 3)), jnp.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  # Non-trivial scales and biases (zero_init and ones would hide a wrong scale or bias gradient).
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  params = jax.tree_util.tree_map_with_path(
    lambda path, p: p + 0.3 * jax.random.normal(k1 if "scale" in str(path) else k2, p.shape) if p.ndim == 1 else p,
    variables["params"],
  )

  def loss(p):
    (y, aux), state = model.apply({**variables, "params": p}, x, True, mutable=["batch_stats"])
    target = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * target) + jnp.sum(aux["stage2"] ** 2) / 100, (y, state)

  (value, (y, state)), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return value, y, grads, state


@pytest.mark.parametrize(
  "depth,stem,group_size",
  [(26, "imagenet", 4), (10, "small", 0), (10, "small", 2)],
  ids=["bottleneck-groups4", "basic-whole-batch", "basic-groups2"],
)
def test_fused_batch_norm_act_matches_the_plain_backbone(depth, stem, group_size):
  plain = resnet_outputs(depth, stem, group_size)
  fused = resnet_outputs(depth, stem, group_size, fused_bn_act=True)
  np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5)
  np.testing.assert_allclose(fused[1], plain[1], rtol=1e-5, atol=1e-5)
  assert_trees_close(fused[2], plain[2])
  assert_trees_close(fused[3], plain[3])  # the running statistics too
  # The gradients are not all zero: scale, bias and convolution kernels of every stage learn.
  assert float(jnp.abs(fused[2]["layer4_block0"]["conv1"]["kernel"]).max()) > 1e-4
  assert float(jnp.abs(fused[2]["bn1"]["scale"]).max()) > 1e-4


def test_fast_max_pool_routes_gradients_as_select_and_scatter():
  import flax.linen as nn

  from vlrep.models import fused

  rng = np.random.default_rng(0)
  for shape in [(2, 8, 8, 3), (2, 7, 9, 4), (1, 16, 16, 2)]:
    # Small integers after a ReLU: most windows hold ties (zeros), where only the first maximum may take the gradient.
    x = jnp.asarray(np.maximum(rng.integers(-3, 3, size=shape), 0), jnp.float32)
    dy = jnp.asarray(rng.normal(size=fused.max_pool_3x3_s2(x).shape), jnp.float32)

    def plain(x):
      return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))

    np.testing.assert_array_equal(fused.max_pool_3x3_s2(x), plain(x))
    g_plain = jax.vjp(plain, x)[1](dy)[0]
    g_fast = jax.vjp(fused.max_pool_3x3_s2, x)[1](dy)[0]
    np.testing.assert_allclose(g_fast, g_plain, rtol=1e-6, atol=1e-6)
    assert float(jnp.sum(g_plain != 0)) > 0


def test_fast_max_pool_in_the_backbone_matches_the_plain_backbone():
  plain = resnet_outputs(18, "imagenet", 4)
  fast = resnet_outputs(18, "imagenet", 4, fast_max_pool=True, fused_bn_act=True)
  np.testing.assert_allclose(fast[0], plain[0], rtol=1e-5)
  assert_trees_close(fast[2], plain[2])


def test_rbg_dropout_draws_other_masks_of_the_same_rate_and_leaves_dropout_free_maths_alone():
  from vlrep import train_step as train_step_lib

  params = virtex_loss_and_grads({})[2]  # initialised once (under rbg, the initialisation draws differ too)

  def loss_under(impl, dropout):
    with train_step_lib.prng_impl(ml_collections.ConfigDict({"rng_impl": impl})):
      return float(virtex_loss_and_grads(dict(dropout=dropout), params=params)[0])

  assert loss_under("rbg", 0.0) == pytest.approx(loss_under("threefry2x32", 0.0), rel=1e-6)
  with_threefry, with_rbg = loss_under("threefry2x32", 0.5), loss_under("rbg", 0.5)
  assert with_rbg != with_threefry  # the switch is in force: other masks
  assert with_rbg == pytest.approx(with_threefry, rel=0.2)  # of the same rate: the same loss scale
  with pytest.raises(ValueError, match="Unknown rng_impl 'philox'"):
    train_step_lib.prng_impl(ml_collections.ConfigDict({"rng_impl": "philox"}))


def test_dropout_masks_under_rbg_keep_the_configured_share():
  import flax.linen as nn

  with jax.default_prng_impl("rbg"):
    kept = nn.Dropout(0.1).apply({}, jnp.ones((200, 500)), deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
  share = float(jnp.mean(kept > 0))
  assert abs(share - 0.9) < 5 * np.sqrt(0.9 * 0.1 / 1e5), share


# Switches that sum the convolutions' products in another order are compared at 64x64 inputs. At 32x32 the
# ImageNet stem leaves the last stage 1x1, so each BatchNorm group of 4 images has 4 values per channel and the
# plain path itself is ill-conditioned: perturbing its input by 1e-7 (relative) moves its output by 1.2e-3 and
# its gradients by 2.6e-3 (relative). At 64x64 the same perturbation moves the output by 6.4e-6 and the
# gradients by 1.5e-5 of their largest magnitude, so rounding fits in the tolerances below and a wrong product does not.
WELL_CONDITIONED = 64


@pytest.mark.parametrize("depth", [26, 10], ids=["bottleneck", "basic"])
def test_one_by_one_convolutions_as_matrix_products_match_the_plain_backbone(depth):
  plain = resnet_outputs(depth, "imagenet", 4, WELL_CONDITIONED)
  dot = resnet_outputs(depth, "imagenet", 4, WELL_CONDITIONED, conv1x1_as_dot=True)
  np.testing.assert_allclose(dot[0], plain[0], rtol=1e-5)
  assert_trees_close(dot[1], plain[1])
  assert_trees_close(dot[2], plain[2])
  # Strided 1x1 convolutions (the downsampling shortcuts) are among them, and their kernels learn.
  assert float(jnp.abs(dot[2]["layer2_block0"]["downsample_conv"]["kernel"]).max()) > 1e-4


def test_runs_saved_with_the_removed_pallas_conv1x1_switch_off_still_build():
  """`method.backbone.pallas_conv1x1` was removed (slower than XLA on an H200, docs/speed.md); runs saved before
  carry it. Off, the model builds as without it (the same parameters, so its checkpoints restore); on, a clear
  error."""
  from conftest import load_tiny_config

  from vlrep import methods

  def init(**backbone):
    cfg = load_tiny_config("").method
    with cfg.unlocked():
      cfg.backbone.update(backbone)
    batch = {"image": jnp.zeros((2, 32, 32, 3)), "tokens": jnp.zeros((2, 12), jnp.int32)}
    return methods.build(cfg, vocab_size=60).init(jax.random.PRNGKey(0), batch)

  jax.tree.map(np.testing.assert_array_equal, init(pallas_conv1x1=False), init())
  with pytest.raises(ValueError, match=r"pallas_conv1x1=True was removed: .* slower than XLA.* H200 .*Drop the key"):
    init(pallas_conv1x1=True)
