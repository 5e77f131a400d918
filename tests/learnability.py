"""The learnability check of tests/test_data.py, run as its own process (`python tests/learnability.py` prints
JSON): a ResNet-10 with the small stem trained on synthetic_scenes' shape-presence labels, on 2.1.0's geometry and
on 1.1.0's radii. The test suite compiles at XLA's optimization level 0 (conftest: its models are tiny and
compiling is most of their time); this check computes for a minute, and its margins hold at level 1, so it runs
in a process of its own at level 1."""

import json

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.metrics import average_precision_score

from vlrep.data import scenes
from vlrep.models import resnet


def shape_presence_data(train=1500, test=400, seed=0):
  """synthetic_scenes 2.1.0 'main' scenes at 64 px and which of the 10 shapes each contains."""
  xs, ys = [], []
  for child in np.random.SeedSequence(seed).spawn(train + test):
    s = scenes.generate_scene(np.random.default_rng(child), 64, "main")
    xs.append(s["image"])
    ys.append(np.isin(np.arange(len(scenes.SHAPES)), [scenes.SHAPES.index(o["shape"]) for o in s["objects"]]))
  x, y = np.stack(xs).astype(np.float32) / 127.5 - 1, np.stack(ys).astype(np.float32)
  return (x[:train], y[:train]), (x[train:], y[train:])


def supervised_presence_map(data, stem, steps=150, seed=0):
  """Held-out mAP of a ResNet-10 w16 trained on the shape-presence labels themselves (AdamW 3e-3, batch 32)."""
  (x, y), (test_x, test_y) = data

  class Net(nn.Module):
    @nn.compact
    def __call__(self, images, train):
      _, aux = resnet.ResNet(depth=10, width=16, stem=stem, name="backbone")(images, train)
      return nn.Dense(y.shape[1])(aux["pre_logits"])

  net = Net()
  variables = net.init(jax.random.PRNGKey(seed), x[:2], False)
  tx = optax.adamw(3e-3, weight_decay=1e-4)
  opt = tx.init(variables["params"])

  @jax.jit
  def step(variables, opt, xb, yb):
    def loss_fn(params):
      logits, new = net.apply({**variables, "params": params}, xb, True, mutable=["batch_stats"])
      return optax.sigmoid_binary_cross_entropy(logits, yb).mean(), new

    (_, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
    updates, opt = tx.update(grads, opt, variables["params"])
    return {"params": optax.apply_updates(variables["params"], updates), **new}, opt

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    i = rng.integers(0, len(x), 32)
    variables, opt = step(variables, opt, x[i], y[i])
  scores = np.asarray(net.apply(variables, test_x, False))
  return 100 * np.mean([average_precision_score(test_y[:, k], scores[:, k]) for k in range(y.shape[1])])


def main():
  data = shape_presence_data()
  out = {"chance": float(100 * data[1][1].mean()), "small": float(supervised_presence_map(data, "small"))}
  scenes.RADIUS = {"small": (0.07, 0.1), "large": (0.14, 0.2)}  # 1.1.0's radii
  out["old_geometry"] = float(supervised_presence_map(shape_presence_data(), "small"))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
