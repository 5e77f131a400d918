"""The speed tools: FLOP counting for MFU, the train-step benchmark, the PyTorch reference, the input pipeline
benchmark's two implementations."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_tiny_config

from vlrep.bench import benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  from vlrep.bench.torch_reference import TorchVirTex

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
  from vlrep.bench import pipeline_benchmark as pb

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


def test_torch_reference_runs_vlreps_optimizer_and_grouped_batch_norm_on_cpu():
  torch = pytest.importorskip("torch")
  from vlrep.bench import torch_reference as ref

  # Grouped BatchNorm: each group of images normalised by its own statistics, as separate BatchNorms would.
  torch.manual_seed(0)
  grouped = ref.GroupedBatchNorm2d(3, 2)
  with torch.no_grad():
    grouped.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
    grouped.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
  x = torch.randn(6, 3, 4, 5) * torch.arange(1, 7.0).reshape(6, 1, 1, 1)  # groups of very different scales
  plain = torch.nn.BatchNorm2d(3)
  plain.load_state_dict(grouped.state_dict())
  expected = torch.cat([plain(x[i : i + 2]) for i in range(0, 6, 2)])
  torch.testing.assert_close(grouped(x), expected, rtol=1e-5, atol=1e-5)
  group_means = x.reshape(3, 2, 3, 4, 5).mean((1, 3, 4)).mean(0)
  torch.testing.assert_close(grouped.running_mean, 0.1 * group_means, rtol=1e-5, atol=1e-6)

  model = ref.TorchVirTex(60, 64, 1, 10, depth=50, bn_group_size=2)
  opt = ref.make_optimizer(model, 0.05, 0.05, 0.9, 1e-4, fused=False)
  names = {id(p): n for n, p in model.named_parameters()}
  no_decay = {names[id(p)] for p in opt.param_groups[2]["params"]}
  assert "output_bias" in no_decay and "embedding_ln.weight" in no_decay
  assert "forward_decoder.layers.0.norm2.weight" in no_decay and "visual_projection.weight" not in no_decay
  assert all(names[id(p)].startswith("backbone.") for p in opt.param_groups[0]["params"])
  lookahead = ref.LookAhead(model.parameters(), 3, 0.5)
  step = ref.make_step(model, opt, 1.0, "cpu")
  images, tokens = torch.randn(4, 3, 64, 64), torch.randint(5, 60, (4, 10))
  tokens[:, 0], tokens[:, -1] = 2, 3
  losses = []
  for _ in range(6):
    losses.append(float(step(images, tokens)))
    lookahead.after_step()
  # After the sync at step 6 the model's parameters are the slow weights.
  for p, slow in zip(model.parameters(), lookahead.slow, strict=True):
    torch.testing.assert_close(p.detach(), slow)
  assert losses[-1] < losses[0] - 0.5, losses


def test_peak_table_tells_the_h100_variants_apart():
  assert benchmark.peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12  # SXM5
  assert benchmark.peak_flops_of("NVIDIA H100 PCIe") == 756e12
  assert benchmark.peak_flops_of("NVIDIA H100 NVL") == 835e12
  assert benchmark.peak_flops_of("NVIDIA H200") == 989e12
  assert benchmark.peak_flops_of("NVIDIA H200 NVL") == 835e12
  assert benchmark.peak_flops_of("NVIDIA L4") == 121e12
  assert benchmark.peak_flops_of("NVIDIA L40S") is None and benchmark.peak_flops_of("cpu") is None


def test_kernel_classes_of_real_gpu_kernel_names():
  names = {
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_cudnn": "convolution fprop",
    "sm80_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x64x64": "convolution dgrad",
    "sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "convolution wgrad",
    "nvjet_hsh_256x128_64x4_1x2_h_bz_coopB_TNN": "GEMM",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "GEMM",
    "input_reduce_fusion_12": "reduction",
    "loop_multiply_fusion_3": "elementwise",
    "loop_transpose_fusion": "copy / transpose",
    "select_and_scatter_5": "select-and-scatter",
    "rng_bit_generator_2": "RNG",
  }
  assert {n: benchmark.kernel_class(n) for n in names} == names


def test_profile_table_sums_kernel_time_by_class_and_finds_idle_gaps():
  meta = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
  ]
  kernels = [
    {"ph": "X", "pid": 1, "tid": 7, "name": "sm90_xmma_fprop_implicit_gemm", "ts": 0.0, "dur": 10.0},
    {"ph": "X", "pid": 1, "tid": 8, "name": "nvjet_hsh_gemm", "ts": 5.0, "dur": 10.0},  # overlaps: another stream
    {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "ts": 20.0, "dur": 5.0},
    {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "ts": 25.0, "dur": 0.0},  # the same kernel again
    {"ph": "X", "pid": 2, "tid": 9, "name": "PjitFunction(step)", "ts": 0.0, "dur": 100.0},  # host: not a kernel
  ]
  events = benchmark.device_kernel_events({"traceEvents": meta + kernels})
  assert len(events) == 4
  table = benchmark.profile_table(events, steps=1)
  assert table["classes"]["convolution fprop"]["ms_per_step"] == pytest.approx(0.010)
  assert table["classes"]["GEMM"]["share"] == pytest.approx(0.4)
  assert table["busy_ms_per_step"] == pytest.approx(0.020)  # the union of [0, 15] and [20, 25]
  assert table["idle_ms_per_step"] == pytest.approx(0.005) and table["span_ms_per_step"] == pytest.approx(0.025)
  assert "| idle gaps | 0.01 |" in benchmark.profile_markdown({"a": table})
  # Kernels by name, the most time first, calls of one name summed.
  top = [(k["name"], k["class"], k["ms_per_step"], k["calls_per_step"]) for k in table["top_kernels"]]
  assert top[0][:2] == ("sm90_xmma_fprop_implicit_gemm", "convolution fprop") and top[1][0] == "nvjet_hsh_gemm"
  assert top[2] == ("loop_add_fusion", "elementwise", pytest.approx(0.005), 2)
  assert "| `loop_add_fusion` | elementwise | 0.005 | 2 |" in benchmark.profile_markdown({"a": table})


def test_overrides_and_variants_are_checked():
  config = load_tiny_config()
  changed = benchmark.apply_overrides(config, "method.dropout=0.25,sharding.params=fsdp,optim.lookahead_alpha=0.25")
  assert changed.method.dropout == 0.25 and changed.sharding.params == "fsdp" and changed.optim.lookahead_alpha == 0.25
  assert config.method.dropout != 0.25 and config.sharding.params == "replicate"  # the baseline is untouched
  with pytest.raises(ValueError, match="has no 'droput'"):
    benchmark.apply_overrides(config, "method.droput=0.25")
  # A removed speed switch is an unknown key like any other.
  with pytest.raises(ValueError, match="has no 'fused_qkv'"):
    benchmark.apply_overrides(config, "method.fused_qkv=True")
  with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
    benchmark.parse_variant("sharding.params=fsdp")
  assert benchmark.parse_variant("fsdp:sharding.params=fsdp") == ("fsdp", "sharding.params=fsdp")


def test_benchmark_times_variants_round_robin_and_profiles_them(tmp_path):
  config = load_tiny_config()
  result = benchmark.benchmark(
    config,
    2,
    32,
    200,
    windows=3,
    # fsdp: another program (sharded state) for the same maths on one device.
    variants=(("fsdp", "sharding.params=fsdp"), ("broken", "method.backbone.depth=7")),
    gemm_size=128,
    profile_dir=str(tmp_path),
    profile_steps=1,
    compile_threads=3,  # built in threads: the same maths as one after the other
    profile_variants=("baseline", "fsdp", "broken"),
    offload_states=True,  # states wait in host memory between windows: the same steps
  )
  assert result["compile_threads"] == 3 and result["build_seconds"] > 0
  assert len(result["window_step_seconds"]) == 3
  assert result["images_per_second_min"] <= result["images_per_second"] <= result["images_per_second_max"]
  fsdp = result["variants"]["fsdp"]
  assert fsdp["speedup_vs_baseline"] == pytest.approx(fsdp["images_per_second"] / result["images_per_second"])
  # Same maths: the two variants reach the same loss on the same batches.
  assert fsdp["final_loss"] == pytest.approx(result["final_loss"], rel=1e-4)
  # A variant that does not build is reported with its error; the others are still timed and profiled.
  assert "Unsupported ResNet depth 7" in result["variants"]["broken"]["error"]
  assert "broken" not in result["profile"]
  assert result["measured_gemm_peak_tflops"] > 0 and result["mfu_vs_measured_gemm_peak"] > 0
  assert result["mfu"] is None  # a CPU has no datasheet peak
  table = (tmp_path / "profile.md").read_text()
  assert "| kernel class | baseline: ms/step (share) | fsdp: ms/step (share) |" in table
  assert "convolution" in table and os.path.exists(result["profile"]["fsdp"]["trace"])


def test_the_gpu_benchmarks_import_no_tensorflow():
  # GPU machines may have JAX and PyTorch but no TensorFlow: the step and reference benchmarks and the
  # configs they time must load without it (a TensorFlow import anywhere below them fails here).
  code = """
import importlib.abc, importlib.util, sys
class NoTF(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in ('tensorflow', 'tensorflow_datasets', 'clu', 'grain', 'array_record'):
      raise ImportError('no ' + name)
sys.meta_path.insert(0, NoTF())
import vlrep.bench.benchmark, vlrep.bench.torch_reference
from vlrep import methods
for name, arg in [('virtex', ''), ('loctex', ''), ('mct', 'text=scratch,tags=True')]:
  spec = importlib.util.spec_from_file_location(name, f'configs/{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  methods.build(config.method, 256)  # a method's module is imported by name when built
print('ok')
"""
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
