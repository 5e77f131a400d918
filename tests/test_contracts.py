"""Every method module in vlrep/methods and every evaluator module in vlrep/evaluators keeps its package's contract
(the `typing.Protocol`s `methods.Method`, `methods.UsesPretrained`, `methods.NamesPretrainedRuns` and
`evaluators.Evaluator`): the modules are found by reading the packages, so a new one is checked without being listed
here. Methods and evaluators are built from the tests' tiny configs (tests/tiny_*.py); nothing is trained or
compiled."""

import glob
import importlib
import inspect
import os
import pkgutil

import pytest
from conftest import TESTS
from ml_collections import ConfigDict

from vlrep import evaluators, methods, modules, run_setup
from vlrep.data import pipeline


def contract_violations(cls: type, protocol: type) -> list[str]:
  """What `cls` lacks of `protocol`'s methods: one it does not have, or one whose parameters are named otherwise.
  (A runtime-checkable protocol's `isinstance` only asks whether the names exist.)"""
  out = []
  for name, wanted in vars(protocol).items():
    if name.startswith("_") or not inspect.isfunction(wanted):
      continue
    have = inspect.getattr_static(cls, name, None)
    if not callable(have):
      out.append(f"{cls.__name__} has no method {name}")
      continue
    want_params, have_params = list(inspect.signature(wanted).parameters), list(inspect.signature(have).parameters)
    if have_params != want_params:
      out.append(f"{cls.__name__}.{name}({', '.join(have_params)}): the contract's is {name}({', '.join(want_params)})")
  return out


def module_names(package) -> list[str]:
  return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg)


@pytest.fixture(scope="module")
def tiny_runs() -> dict:
  """{tiny config's module: (config, EvalInputs)}, each built as the loop builds a run (`run_setup.build`)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(TESTS, "tiny_*.py"))):
    name = os.path.basename(path)[:-3]
    config = importlib.import_module(name).get_config()
    out[name] = (config, run_setup.build(config)[1])
  return out


@pytest.mark.parametrize("name", module_names(methods))
def test_every_method_module_keeps_the_method_contract(name, tiny_runs):
  module = importlib.import_module(f"vlrep.methods.{name}")
  assert hasattr(module, "Method") == (name in methods.available()), "vlrep.methods lists what defines Method"
  if not hasattr(module, "Method"):
    assert name.startswith("_"), f"vlrep.methods.{name} defines no Method: name a helper module _{name}"
    return
  cls = module.Method
  assert contract_violations(cls, methods.Method) == []
  # Built as `Method(config, vocab_size, **needs)`: anything beyond the first two comes from the run's setup.
  params = list(inspect.signature(cls).parameters.values())
  assert [p.name for p in params[:2]] == ["config", "vocab_size"]
  assert all(p.default is not inspect.Parameter.empty for p in params[2:]), params
  if hasattr(module, "setup"):
    assert list(inspect.signature(module.setup).parameters) == ["config", "builder", "tokenizer"]

  built = [inputs.method for config, inputs in tiny_runs.values() if config.method.name == name]
  assert built, f"no tests/tiny_*.py config trains method {name!r}: add one (the contract is checked on it)"
  for method in built:
    assert isinstance(method, methods.Method)
    assert method.fields and all(isinstance(f, str) for f in method.fields)
    for optional in (methods.UsesPretrained, methods.NamesPretrainedRuns):
      if isinstance(method, optional):
        assert contract_violations(cls, optional) == []
    # Runs named in pretrained_runs are handed to pretrained_variables: one without the other loads them for nothing.
    assert isinstance(method, methods.UsesPretrained) or not isinstance(method, methods.NamesPretrainedRuns)


@pytest.mark.parametrize("name", module_names(evaluators))
def test_every_evaluator_module_keeps_the_evaluator_contract(name, tiny_runs):
  module = importlib.import_module(f"vlrep.evaluators.{name}")
  assert hasattr(module, "Evaluator") == (name in evaluators.available()), "vlrep.evaluators lists what defines it"
  if not hasattr(module, "Evaluator"):
    assert name.startswith("_"), f"vlrep.evaluators.{name} defines no Evaluator: name a helper module _{name}"
    return  # a helper of the evaluators (metrics, solvers, EvalInputs)
  cls = module.Evaluator
  assert contract_violations(cls, evaluators.Evaluator) == []
  assert list(inspect.signature(cls).parameters) == ["config", "inputs"]
  assert isinstance(getattr(cls, "needs_method", False), bool)
  test_metrics = getattr(module, "TEST_METRICS", ())
  assert isinstance(test_metrics, tuple) and all(isinstance(m, str) for m in test_metrics)
  for config, inputs in tiny_runs.values():
    for cfg in config.get("evals", {}).values():
      if cfg.type == name:
        assert isinstance(evaluators.build(cfg, inputs), evaluators.Evaluator)


def test_the_checks_catch_a_missing_member_and_a_wrong_signature():
  class OldCallingMode:
    config = None

    def evaluate(self, features_fn, variables=None):
      return {}

  class NoEvaluate:
    config = None

  class NoFeatures:
    fields = ("image",)

    def init(self, rng, batch):
      return {}

    def loss(self, variables, batch, rng, train=True):
      return 0.0, {}, {}

  assert contract_violations(OldCallingMode, evaluators.Evaluator) == [
    "OldCallingMode.evaluate(self, features_fn, variables): the contract's is evaluate(self, model)"
  ]
  assert isinstance(OldCallingMode(), evaluators.Evaluator)  # why the parameters are checked as well
  assert contract_violations(NoEvaluate, evaluators.Evaluator) == ["NoEvaluate has no method evaluate"]
  assert not isinstance(NoEvaluate(), evaluators.Evaluator)
  assert contract_violations(NoFeatures, methods.Method) == ["NoFeatures has no method features"]
  assert not isinstance(NoFeatures(), methods.Method)


def test_an_unknown_name_lists_what_the_package_has():
  with pytest.raises(ValueError, match=f"Unknown method 'nope'. Known: {', '.join(methods.available())}$"):
    methods.build(ConfigDict({"name": "nope"}), 0)
  assert "clip" in methods.available() and "_contrastive" not in methods.available()
  with pytest.raises(ValueError, match="Unknown evaluator type '_linear_svm'. Known: .*voc07_svm"):
    evaluators.needs_method(ConfigDict({"type": "_linear_svm"}))  # a helper module, not an evaluator
  datasets = pipeline.builder_classes()
  # A module per dataset, named as it: vlrep.data.builders.<name> defines the builder of dataset <name>.
  assert sorted(datasets) == list(modules.available("data.builders")) and len(datasets) >= 11
  assert all(cls.name == name and cls.__module__ == f"vlrep.data.builders.{name}" for name, cls in datasets.items())
  with pytest.raises(ValueError, match="Unknown dataset '_vl_datasets'. Known: coco_captions2017, "):
    pipeline.builder_class("_vl_datasets")  # a helper module, not a dataset
  assert [n for n, cls in datasets.items() if getattr(cls, "generated_on_first_use", False)] == ["synthetic_scenes"]
  with pytest.raises(ValueError, match=f"neither one of vlrep's \\({', '.join(sorted(datasets))}\\)"):
    pipeline.get_builder("no_such_dataset", os.path.join(TESTS, "no_data_here"))
