import importlib.util
import mmap
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("VLREP_TEST_DATA_DIR", "/tmp/vlrep_test_data")
# JAX's persistent compilation cache, shared by the tests and the training subprocesses they start: many tests
# compile the same tiny models' train and init steps (seconds each on CPU). Only compiles of 0.5 s or more are
# written: the thousands of single operations that op-by-op code compiles (median 0.04 s, all under 0.25 s for a
# ResNet-10's init) cost more to compress and write than a hit saves, since a hit still lowers the operation.
# Set before jax is imported (it reads these at import).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["VLREP_TEST_DATA_DIR"], "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# XLA's CPU backend at LLVM optimization level 0 for every test and the subprocesses they start: the tests' models
# are tiny, so compiling is most of their time, and level 0 compiles faster than level 1 or the default by more
# than its slower code costs them. Both sides of every equality test (1 vs 8 devices, resumed vs uninterrupted) run
# under the same flags. The one compute-bound test (learnability) runs in a process of its own at level 1, the
# level its margins hold at.
# XLA's CPU fusion emitters off as well: its older emitters compile the tests' small programs in about half the
# time, with values equal up to float rounding. The flag is passed only where this jaxlib knows it: an unknown
# flag in XLA_FLAGS aborts the process.
_FLAGS = ["--xla_backend_optimization_level=0"]


def _jaxlib_knows(flag: str) -> bool:
  spec = importlib.util.find_spec("jaxlib")
  library = os.path.join(os.path.dirname(spec.origin), "libjax_common.so") if spec and spec.origin else ""
  if not os.path.exists(library):
    return False
  with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    return m.find(flag.encode()) >= 0


if _jaxlib_knows("xla_cpu_use_fusion_emitters"):
  _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([*_FLAGS, os.environ.get("XLA_FLAGS", "")]).strip()
# triton (torch's GPU kernel compiler, a dependency of the Linux torch wheel) crashes the process when it loads after
# TensorFlow: both carry LLVM, and its static initialisers run against TensorFlow's global LLVM symbols (a segfault
# in llvm::DebugCounter). torch._dynamo probes for it on import, and transformers imports torch._dynamo. The tests
# run torch on the CPU, where triton has no use: marked absent, the probe gets an ImportError instead.
sys.modules["triton"] = None
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

import pytest  # noqa: E402

# Test files, slowest first (their CI durations on 2 cores). With `--dist loadfile` each file is one unit of work
# and xdist hands them out in this order, so the long ones start first and both workers stay busy to the end (the
# longest-processing-time-first rule; by default xdist orders files by how many tests they hold, which would start
# the few long multi-process tests last and leave one worker idle for minutes).
SLOWEST_FIRST = (
  "test_docs_commands.py",
  "test_multihost.py",
  "test_vlbert.py",
  "test_faults.py",
  "test_attack_corpus.py",  # about 250 forked commands: 1.5-4 min
  "test_mct.py",
  "test_own_data.py",
  "test_own_data_real_photos.py",
  "test_detection.py",
  "test_icmlm.py",
  "test_evaluation.py",
  "test_vit_evaluators.py",
  "test_import_run.py",
  "test_own_labelled.py",
  "test_run_folder_attacks.py",
  "test_prepare_attacks.py",
  "test_nothing_lost.py",
  "test_distributed.py",
  "test_data.py",
  "test_models_optim_eval.py",
  "test_speed_tools.py",
  "test_export.py",
  "test_loctex.py",
  "test_clip.py",
  "test_vit.py",
  "test_open_clip_checkpoints.py",
  "test_hf_clip_checkpoints.py",
  "test_cappa.py",
  "test_import_visual_bert.py",
  "test_architecture.py",
  "test_train.py",
  "test_vsepp.py",
)


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6: keep SLOWEST_FIRST's order
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_sessionstart(session):
  """Generates the tiny dataset once, under a file lock: with pytest-xdist (`-n 2`) the workers start together
  and would otherwise race to write the same TFDS directory. xdist's controller process leaves it to the workers:
  it runs no test, and the workers start only after its session start (importing TensorFlow alone takes it
  seconds)."""
  if session.config.getoption("dist", "no") != "no" and not os.environ.get("PYTEST_XDIST_WORKER"):
    return
  from filelock import FileLock

  data_dir = os.environ["VLREP_TEST_DATA_DIR"]
  os.makedirs(data_dir, exist_ok=True)
  with FileLock(os.path.join(data_dir, ".generate.lock")):
    from vlrep.data import pipeline

    pipeline.get_builder("synthetic_scenes", data_dir, "tiny")


def with_devices(n: int, env=None) -> dict:
  """`env` (default: this process's) with `n` host-platform devices added to XLA_FLAGS (keeping the other flags)."""
  env = dict(os.environ if env is None else env)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
  return env


def final_params(workdir):
  """(step, params as numpy) of the newest checkpoint in `workdir`: a raw restore (no target), onto this
  process's first device whatever device count wrote it."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  step = max(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit())
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(path).item_metadata
  state = checkpointer.restore(
    path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
  )
  return step, jax.tree.map(np.asarray, state["params"])


def load_tiny_config(arg=None):
  import tiny_virtex

  return tiny_virtex.get_config(arg)


def shared_run(tmp_path_factory, config: str):
  """One default tiny run of `config` (tests/tiny_NAME.py, `run_main` with no overrides: a few steps and the
  config's evaluations), trained once per test session and shared by every xdist worker (under a file lock in the
  session's shared temp root): tests that only need *a* trained run read it; tests that change a run (resume it,
  evaluate into it) copy it first. Returns the workdir and the run's console (returncode, stdout, stderr)."""
  import json
  import types

  from filelock import FileLock

  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  name = os.path.splitext(os.path.basename(config))[0] + "_run"
  workdir, console = root / name, root / f"{name}.json"
  with FileLock(str(root / f"{name}.lock")):
    if not console.exists():
      proc = run_main(workdir, config=config)
      console.write_text(json.dumps({"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}))
  return types.SimpleNamespace(workdir=workdir, **json.loads(console.read_text()))


@pytest.fixture(scope="session")
def tiny_virtex_run(tmp_path_factory):
  """tests/tiny_virtex.py's shared run (6 steps, the probe and captioning evaluations): the quick start's."""
  return shared_run(tmp_path_factory, "tests/tiny_virtex.py")


@pytest.fixture(scope="session")
def tiny_loctex_run(tmp_path_factory):
  """tests/tiny_loctex.py's shared run: LocTex runlocal's documented command and its end-to-end test."""
  return shared_run(tmp_path_factory, "tests/tiny_loctex.py")


@pytest.fixture(scope="session")
def tiny_mct_run(tmp_path_factory):
  """tests/tiny_mct.py's shared run: MCT runlocal's documented command and its end-to-end test."""
  return shared_run(tmp_path_factory, "tests/tiny_mct.py")


@pytest.fixture(scope="session")
def tiny_clip_run(tmp_path_factory):
  """tests/tiny_clip.py's shared run (CLIP, a one-layer text tower): vlrep.load's and vlrep.predict's tower."""
  return shared_run(tmp_path_factory, "tests/tiny_clip.py")


@pytest.fixture(scope="session")
def tiny_icmlm_run(tmp_path_factory):
  return shared_run(tmp_path_factory, "tests/tiny_icmlm.py")


@pytest.fixture(scope="session")
def tiny_vlbert_run(tmp_path_factory):
  return shared_run(tmp_path_factory, "tests/tiny_vlbert.py")


@pytest.fixture(scope="session")
def tiny_finetune_run(tmp_path_factory):
  """tests/tiny_finetune.py's shared run (the classifier method)."""
  return shared_run(tmp_path_factory, "tests/tiny_finetune.py")


@pytest.fixture(scope="session")
def tiny_builder():
  from vlrep.data import pipeline

  return pipeline.get_builder("synthetic_scenes", os.environ["VLREP_TEST_DATA_DIR"], "tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_builder):
  from vlrep.data import tokenizers

  return tokenizers.ensure_tokenizer(load_tiny_config().tokenizer, tiny_builder)


_runner = None  # this process's command server (vlrep.bench.forkserver), started by the first run_main


def run_main(workdir, *overrides, env=None, config="tests/tiny_virtex.py", timeout=600):
  """Runs `python -m vlrep.main` in a process of its own; returns a CompletedProcess (stdout and stderr apart).

  The process is forked from a command server that imported JAX, TensorFlow and the rest once per test worker, so
  a run skips those imports; it is otherwise `python -m vlrep.main` with these arguments, in this
  environment plus `env` (XLA_FLAGS in `env` are added to this process's)."""
  return run_module("vlrep.main", f"--config={config}", f"--workdir={workdir}", *overrides, env=env, timeout=timeout)


def command_server():
  """This test worker's process server (vlrep.bench.forkserver), started on first use."""
  global _runner
  if _runner is None:
    from vlrep.bench import forkserver

    # tests/ on the path of its children (as `python tests/FILE.py` puts it): a module of tests/ runs too.
    paths = [TESTS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    _runner = forkserver.Server({**os.environ, "PYTHONPATH": os.pathsep.join(paths)}, cwd=ROOT)
  return _runner


def run_module(module, *args, env=None, timeout=600):
  """`python -m MODULE ARGS` as run_main runs vlrep.main: forked from the worker's command server (modules of tests/
  are found too); a CompletedProcess."""
  import subprocess
  import tempfile

  extra = dict(env or {})
  if "XLA_FLAGS" in extra and "XLA_FLAGS" in os.environ:  # added to this process's flags, not replacing them
    extra["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {extra['XLA_FLAGS']}"
  argv = [module, *args]
  with tempfile.TemporaryDirectory() as logs:
    out, err = os.path.join(logs, "stdout"), os.path.join(logs, "stderr")
    rc, _, stdout = command_server().run(argv, out, timeout, err=err, env=extra)
    with open(err, errors="replace") as f:
      stderr = f.read()
  if rc == 124:
    raise subprocess.TimeoutExpired(["python", "-m", *argv], timeout, stdout, stderr)
  return subprocess.CompletedProcess(["python", "-m", *argv], rc, stdout, stderr)


def pytest_sessionfinish(session):
  if _runner is not None:
    _runner.close()


def imported_resnet18(root):
  """torchvision's ResNet-18 with random weights and BatchNorm statistics and affine away from their identity
  defaults (as a trained model's), written by torch.save to ROOT/resnet18.pth and imported as documented
  (`vlrep.interop.import_run --format=torchvision`) into ROOT/run: (the torch model in eval mode, the run's path).
  Skips where torchvision is not installed."""
  torch = pytest.importorskip("torch")
  torchvision = pytest.importorskip("torchvision")
  from vlrep.interop import import_run

  torch.manual_seed(0)
  model = torchvision.models.resnet18()
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for m in model.modules():
      if isinstance(m, torch.nn.BatchNorm2d):
        m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
        m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
        m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
  torch.save(model.state_dict(), os.path.join(root, "resnet18.pth"))
  import_run.import_run("torchvision", os.path.join(root, "resnet18.pth"), os.path.join(root, "run"))
  return model.eval(), os.path.join(root, "run")
