"""The layering rules of vlrep (README's map, docs/architecture.md): vlrep's import graph, function-local imports
included, has no cycle (a module that needs one imported lazily to avoid a circle belongs in another layer), every
module is on a layer, and a module imports only its own layer and those below."""

import ast
import json
import os

import numpy as np
from conftest import ROOT, run_main


def import_graph(package_dir: str, package: str) -> dict[str, set[str]]:
  """module -> the package's modules it imports anywhere in its body (top level or inside functions)."""
  modules = {}
  for dirpath, _, files in os.walk(package_dir):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(package_dir))[:-3].replace(os.sep, ".")
        modules[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)

  def resolve(name: str) -> str:
    while name not in modules and "." in name:
      name = name.rsplit(".", 1)[0]
    return name

  graph = {}
  for name, path in modules.items():
    targets = set()
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == package}
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == package:
        targets |= {resolve(f"{node.module}.{a.name}") for a in node.names}
    graph[name] = targets - {name}
  return graph


def package_modules_of(package_dir: str) -> set[str]:
  """The dotted names of every module and package under `package_dir`."""
  out = set()
  for dirpath, _, files in os.walk(package_dir):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(package_dir))[:-3].replace(os.sep, ".")
        out.add(rel.removesuffix(".__init__"))
  return out


def unresolved_imports(paths: list[str], modules: set[str], package: str) -> list[str]:
  """`path: name` for each `import package.X` or `from package.X import ...` in the files whose package.X is no
  module: a module renamed or moved that an importer still names (its import fails only when it runs, which for a
  function-local import or a command may be never in the tests)."""
  out = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        named = [node.module]
      else:
        continue
      out += [f"{os.path.basename(path)}: {n}" for n in named if n.split(".")[0] == package and n not in modules]
  return sorted(out)


def test_every_import_of_a_vlrep_module_names_one_that_exists(tmp_path):
  modules = package_modules_of(os.path.join(ROOT, "vlrep"))
  paths = [
    os.path.join(dirpath, f)
    for top in ("vlrep", "tests", "configs")
    for dirpath, _, files in os.walk(os.path.join(ROOT, top))
    for f in files
    if f.endswith(".py")
  ]
  assert unresolved_imports(paths, modules, "vlrep") == []
  # The check sees a module that is gone, in either form, and passes names imported from a module.
  (tmp_path / "a.py").write_text("from vlrep.gone import x\nimport vlrep.data.gone\nfrom vlrep.errors import E\n")
  assert unresolved_imports([str(tmp_path / "a.py")], modules, "vlrep") == ["a.py: vlrep.data.gone", "a.py: vlrep.gone"]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  for root in graph:
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      v, children = work[-1]
      w = next(children, None)
      if w is not None:
        if w not in graph:
          continue
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        component = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          component.append(w)
          if w == v:
            break
        if len(component) > 1:
          out.append(sorted(component))
  return out


def test_vlrep_has_no_import_cycle():
  graph = import_graph(os.path.join(ROOT, "vlrep"), "vlrep")
  assert len(graph) > 80 and "vlrep.data.registry" in graph["vlrep.data.pipeline"]
  assert cycles(graph) == []


# Layers, lowest first: a module imports only its own layer and those below it (README's map; docs/architecture.md).
# Every module of vlrep is on one: a module is placed by the longest key that is it or a package above it.
LAYERS = {
  # 0, leaves: no vlrep module above them.
  "vlrep.errors": 0,  # the errors a user can fix (vlrep.main exits with status 2 on them)
  "vlrep.safe_files": 0,  # the one way vlrep writes a file (atomic, never through a link)
  "vlrep.torch_files": 0,  # reading PyTorch / safetensors files without unpickling (numpy only)
  "vlrep.preemption": 0,  # the loop installs it, the pipeline and evaluators check it
  "vlrep.defaults": 0,  # every default the package and the configs share (data dir, protocols)
  "vlrep.modules": 0,  # the one lookup of a name: module vlrep.<kind>.<name>
  "vlrep.run_summary": 0,  # a run folder's summary.json, read and merged with numpy alone (the torch side writes it)
  "vlrep.models": 0,  # Flax modules: tensors in, tensors out
  # 1: data, and the PyTorch wing (numpy, PIL and torch only; tests/test_pytorch_wing.py checks no JAX/TF loads).
  "vlrep.data": 1,  # datasets, ops and tokenizers (token ids and BERT folders come from models)
  "vlrep.pytorch": 1,
  # 2: infrastructure the methods, evaluators and the loop share.
  "vlrep.config_utils": 2,
  "vlrep.checkpoint": 2,
  "vlrep.sharding": 2,
  "vlrep.optim": 2,
  "vlrep.decoding": 2,
  # 3: what a run is made of, and a run folder.
  "vlrep.methods": 3,
  "vlrep.evaluators": 3,
  "vlrep.interop.formats": 3,  # one module per format, both ways; the detection evaluator writes its hand-off with one
  "vlrep.interop.keymaps": 3,  # what the formats share (key maps as data, transforms, safe reading)
  "vlrep.runs": 3,
  "vlrep.run_setup": 3,
  "vlrep.train_state": 3,
  "vlrep.train_step": 3,
  # 4: the loop and the commands users run on runs.
  "vlrep.interop": 4,  # import_run, export
  "vlrep.train": 4,
  "vlrep.visualize": 4,
  "vlrep.tools": 4,  # user tools: never import a command-line module or bench
  "vlrep.inference": 4,  # vlrep.load: a run as a model to use from Python (the tools call it)
  "vlrep.bench": 5,  # vlrep's own benchmarks and harnesses
  "vlrep.main": 6,  # the command-line modules: nothing imports them
  "vlrep.evaluate": 6,
  "vlrep.predict": 6,
}
# Its __init__ imports nothing, so it is on no layer (a key "vlrep" would place everything); `vlrep.load` is looked up
# in vlrep.inference on first use (test_vlrep_load_is_looked_up_on_first_use).
ROOT_PACKAGE = "vlrep"


def layer_of(module: str) -> int | None:
  keys = [k for k in LAYERS if module == k or module.startswith(k + ".")]
  return LAYERS[max(keys, key=len)] if keys else None


def unplaced(graph: dict[str, set[str]]) -> list[str]:
  """The modules of the graph (importers and imported) on no layer."""
  modules = set(graph) | {b for targets in graph.values() for b in targets}
  return sorted(m for m in modules - {ROOT_PACKAGE} if layer_of(m) is None)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  """Every import of a module on a higher layer (an unplaced module counts as the highest)."""

  def layer(module):
    placed = layer_of(module)
    return max(LAYERS.values()) + 1 if placed is None else placed

  return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def test_every_module_is_on_a_layer():
  graph = import_graph(os.path.join(ROOT, "vlrep"), "vlrep")
  assert unplaced(graph) == []
  assert graph[ROOT_PACKAGE] == set(), "vlrep/__init__.py imports nothing, so it needs no layer"
  # The check sees a module added without a layer, as importer or imported, and places a subpackage by its
  # longest key.
  crafted = {"vlrep.new_root": {"vlrep.errors"}, "vlrep.data.ops": {"vlrep.newer"}}
  assert unplaced(crafted) == ["vlrep.new_root", "vlrep.newer"]
  assert layer_of("vlrep.interop.formats.torchvision") == 3 and layer_of("vlrep.interop.export") == 4
  assert layer_of("vlrep.data.manual_files") == 1 and layer_of("vlrep") is None


def test_layers_import_only_their_own_and_lower_layers():
  graph = import_graph(os.path.join(ROOT, "vlrep"), "vlrep")
  assert layer_violations(graph) == []
  # The check sees a violation where there is one: upward, into a subpackage's higher parent, and into an
  # unplaced module.
  assert layer_violations({"vlrep.models.x": {"vlrep.data.tokenizers"}}) == ["vlrep.models.x -> vlrep.data.tokenizers"]
  assert layer_violations({"vlrep.interop.formats.x": {"vlrep.interop.export"}}) == [
    "vlrep.interop.formats.x -> vlrep.interop.export"
  ]
  assert layer_violations({"vlrep.bench.x": {"vlrep.unplaced"}}) == ["vlrep.bench.x -> vlrep.unplaced"]
  assert layer_violations({"vlrep.train": {"vlrep.runs", "vlrep.train_state", "vlrep.errors"}}) == []


def checkpoint_readers(folder: str) -> list[str]:
  """Files under `folder` that read checkpoints: call `load_run`, or import orbax or vlrep.checkpoint."""
  found = set()
  for dirpath, _, names in os.walk(folder):
    for name in sorted(n for n in names if n.endswith(".py")):
      path = os.path.join(dirpath, name)
      for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Call):
          reads = getattr(node.func, "attr", getattr(node.func, "id", None)) == "load_run"
        elif isinstance(node, ast.Import):
          reads = any(a.name.startswith(("orbax", "vlrep.checkpoint")) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
          modules = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
          reads = any(m.startswith(("orbax", "vlrep.checkpoint")) for m in modules)
        else:
          reads = False
        if reads:
          found.add(os.path.relpath(path, folder))
  return sorted(found)


def test_methods_and_evaluators_read_no_checkpoint_the_loop_hands_them_runs(tmp_path):
  for layer in ("methods", "evaluators", "models", "data"):
    assert checkpoint_readers(os.path.join(ROOT, "vlrep", layer)) == [], layer
  # The check sees a method that loads a run itself.
  (tmp_path / "m.py").write_text("from vlrep import runs\ndef f(p):\n  return runs.load_run(p)\n")
  (tmp_path / "n.py").write_text("import orbax.checkpoint as ocp\n")
  assert checkpoint_readers(str(tmp_path)) == ["m.py", "n.py"]


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg.sub import b\n")
  (pkg / "sub" / "b.py").write_text("def f():\n  from pkg import c\n")
  (pkg / "c.py").write_text("import pkg.a\n")
  (pkg / "d.py").write_text("from pkg import a\n")
  found = cycles(import_graph(str(pkg), "pkg"))
  assert found == [["pkg.a", "pkg.c", "pkg.sub.b"]]


TOY_MODEL = '''
import flax.linen as nn
import jax.numpy as jnp

from vlrep.models import resnet


class Toy(nn.Module):
  """A ResNet whose pooled features predict each image's mean colour."""

  backbone: dict

  @nn.compact
  def __call__(self, images, train: bool = False):
    _, aux = resnet.ResNet(**self.backbone, name="backbone")(images, train)
    return nn.Dense(3, name="head")(aux["pre_logits"]), aux["pre_logits"]
'''

TOY_METHOD = """
import jax
import jax.numpy as jnp

from toy_pkg.model import Toy


class ToyMethod:
  fields = ("image",)

  def __init__(self, config, vocab_size):
    self.model = Toy(backbone=dict(config.backbone))

  def init(self, rng, batch):
    return self.model.init(rng, batch["image"], False)

  def loss(self, variables, batch, rng, train=True):
    (pred, _), state = self.model.apply(variables, batch["image"], train, mutable=["batch_stats"])
    loss = jnp.mean(jnp.square(pred - jnp.mean(batch["image"], axis=(1, 2))))
    return loss, {"toy_loss": loss}, state

  def features(self, variables, images):
    return {"pre_logits": self.model.apply(variables, images, False)[1]}


Method = ToyMethod
"""

TOY_CONFIG = """
import os
import sys

sys.path.insert(0, os.path.join(os.environ["VLREP_ROOT"], "tests"))
import tiny_virtex


def get_config(arg=None):
  c = tiny_virtex.get_config()
  del c["tokenizer"]
  del c.evals["captioning"]
  c.data.pp = "decode|flip_lr_swap_words(keys=())|normalize"
  c.method = dict(name="toy_pkg.method", backbone=dict(depth=10, width=8, bn_group_size=4))
  c.optim.no_decay = ""
  return c
"""


def test_a_method_of_your_own_trains_end_to_end_without_touching_vlrep(tmp_path):
  """A method, its model and its config written outside vlrep: `method.name` is the module's dotted path."""
  pkg = tmp_path / "toy_pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "model.py").write_text(TOY_MODEL)
  (pkg / "method.py").write_text(TOY_METHOD)
  (tmp_path / "toy_config.py").write_text(TOY_CONFIG)
  env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "VLREP_ROOT": ROOT}
  proc = run_main(tmp_path / "run", config=str(tmp_path / "toy_config.py"), env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["steps"] == 6 and np.isfinite(summary["train/loss"]) and 0 < summary["probe/map"] <= 100
  assert os.listdir(tmp_path / "run" / "checkpoints")  # checkpointed like any method


def test_vlrep_load_is_looked_up_on_first_use():
  """`import vlrep` (as every submodule's import does) loads no JAX; `vlrep.load` is vlrep.inference's."""
  import subprocess
  import sys

  code = (
    "import sys, vlrep; assert 'jax' not in sys.modules, 'import vlrep loaded jax'; "
    "load = vlrep.load; import vlrep.inference; assert load is vlrep.inference.load; "
    "print(hasattr(vlrep, 'nothing'))"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
