"""The speed tools: FLOP counting for MFU, the train-step benchmark, the PyTorch reference, the input pipeline
benchmark's two implementations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_tiny_config

from vlrep.tools import benchmark


def test_jaxpr_flops_counts_products_and_convolutions_exactly():
  x, w = jnp.ones((4, 8, 8, 3)), jnp.ones((3, 3, 3, 16))
  conv = jax.make_jaxpr(
    lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  )(x, w)
  assert benchmark.jaxpr_flops(conv) == 2 * (4 * 4 * 4 * 16) * (3 * 3 * 3)
  grouped = jax.make_jaxpr(
    lambda x, w: jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=4
    )
  )(jnp.ones((1, 5, 5, 8)), jnp.ones((1, 1, 2, 12)))
  assert benchmark.jaxpr_flops(grouped) == 2 * (5 * 5 * 12) * 2
  # Batched matmul inside a jit and a scan of 3 steps.
  a, b = jnp.ones((2, 5, 7)), jnp.ones((2, 7, 11))

  def scanned(a, b):
    return jax.lax.scan(lambda c, _: (c, jax.jit(jnp.matmul)(a, b)), 0.0, None, length=3)[1]

  assert benchmark.jaxpr_flops(jax.make_jaxpr(scanned)(a, b)) == 3 * 2 * 2 * 5 * 7 * 11


def test_resnet50_forward_flops_match_the_published_count():
  from vlrep.models import resnet

  model = resnet.ResNet(depth=50)
  x = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, False), x)
  macs = benchmark.jaxpr_flops(jax.make_jaxpr(lambda v, x: model.apply(v, x, False))(variables, x)) / 2
  # torchvision's ResNet-50: 4.09 GMACs at 224 (its 2048x1000 classifier, 2 MMACs, is not part of ours).
  assert abs(macs - 4.089e9) / 4.089e9 < 0.005, macs
  # Forward + backward: 3x, less the stem's input gradient (images need none); strided convolutions' input
  # gradients count only the products that touch non-zeros.
  grad = jax.grad(lambda p, s, x: model.apply({"params": p, "batch_stats": s}, x, False)[0].sum())
  step_macs = benchmark.jaxpr_flops(jax.make_jaxpr(grad)(variables["params"], variables["batch_stats"], x)) / 2
  assert 2.95 < step_macs / macs < 3.0, step_macs / macs


@pytest.mark.parametrize("method,input_mode", [("mct", "host")])  # host: the prefetch path; MCT: all field kinds
def test_benchmark_times_the_real_step_on_cpu(method, input_mode):
  import tiny_mct

  config = load_tiny_config() if method == "virtex" else tiny_mct.get_config()
  result = benchmark.benchmark(config, 2, 32, 200, input_mode)
  assert result["method"] == method
  assert result["input"] == input_mode and result["images_per_second"] > 0 and math.isfinite(result["final_loss"])
  assert result["mfu"] is None  # CPUs have no peak in the table
  # 3x the forward FLOPs of the loss, counted from the model: at least the backbone's convolutions.
  assert result["model_tflops_per_step"] > 0


def test_torch_reference_matches_the_model_and_learns():
  torch = pytest.importorskip("torch")
  from vlrep.tools.torch_reference import TorchVirTex

  torch.manual_seed(0)
  vocab, max_len = 100, 12
  model = TorchVirTex(vocab, 64, 1, max_len, depth=50)
  assert model.forward_decoder.layers[0].self_attn.num_heads == 1  # H/64
  assert model.forward_decoder.layers[0].linear1.out_features == 256  # 4H
  images = torch.randn(4, 3, 64, 64)
  tokens = torch.randint(5, vocab, (4, max_len))
  tokens[:, 0], tokens[:, -1] = 2, 3
  tokens[1, 8:] = 0  # padding is ignored
  loss = model(images, tokens).detach()
  # Two directions, each about log(vocab) at BERT-style initialisation.
  assert abs(float(loss) - 2 * math.log(vocab)) < 1.0, float(loss)
  opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
  model.train()
  for _ in range(15):
    opt.zero_grad()
    model(images, tokens).backward()
    opt.step()
  model.eval()
  with torch.no_grad():
    assert float(model(images, tokens)) < float(loss) - 1.0


def test_pipeline_benchmark_implementations_do_the_same_work(tmp_path):
  pytest.importorskip("torch")
  from vlrep.tools import pipeline_benchmark as pb

  jpegs = pb.make_jpegs(4)
  assert all(b[:2] == b"\xff\xd8" for b in jpegs) and 30_000 < np.mean([len(b) for b in jpegs]) < 400_000
  tf_batch = next(pb.tfdata_batches(jpegs, 1, cache=False))["image"]
  dataset = pb._PilDataset(jpegs)
  torch_batch = np.stack([dataset[i].numpy() for i in range(64)]).transpose(0, 2, 3, 1)
  assert tf_batch.shape == torch_batch.shape == (64, 224, 224, 3) and tf_batch.dtype == torch_batch.dtype
  # Same normalisation and similar random crops: the per-channel statistics of the two batches agree.
  np.testing.assert_allclose(tf_batch.mean((0, 1, 2)), torch_batch.mean((0, 1, 2)), atol=0.15)
  np.testing.assert_allclose(tf_batch.std((0, 1, 2)), torch_batch.std((0, 1, 2)), rtol=0.15)
  # RandomResizedCrop boxes stay inside the image and cover 20-100% of it (or fall back to the centre).
  rng = np.random.default_rng(0)
  for _ in range(200):
    x0, y0, x1, y1 = dataset._crop_box(640, 480, rng)
    assert 0 <= x0 < x1 <= 640 and 0 <= y0 < y1 <= 480
    assert 0.19 * 640 * 480 <= (x1 - x0) * (y1 - y0) <= 640 * 480
  cached = next(pb.tfdata_batches(jpegs, 1, cache=True))["image"]
  assert cached.shape == (64, 224, 224, 3)
  # Read by index from an ArrayRecord file: the very same batch as from memory.
  disk = next(pb.tfdata_batches(jpegs, 1, cache=False, disk=str(tmp_path / "jpegs.array_record")))["image"]
  np.testing.assert_array_equal(disk, tf_batch)
