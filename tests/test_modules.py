"""vlrep.modules, the one lookup of a name in a config: vlrep.<kind>.<name> by import, the entries of a kind listed
from its package's folder (helpers, named with a leading '_', left out), a user's own module by its dotted path, and
all of it safe from many threads at once (vlrep.bench.benchmark --compile_threads builds variants together)."""

import concurrent.futures
import re
import sys

import pytest

from vlrep import modules
from vlrep.errors import UserError


def test_get_imports_the_module_the_name_names():
  module = modules.get("data.builders", "voc2007", "dataset")  # a dotted kind
  assert module.__name__ == "vlrep.data.builders.voc2007" and sys.modules[module.__name__] is module
  assert modules.get("methods", "clip", "method").Method.__module__ == "vlrep.methods.clip"


def test_available_lists_the_entries_and_not_the_helpers():
  methods = modules.available("methods")
  assert list(methods) == sorted(methods) and {"clip", "virtex", "vlbert"} <= set(methods)
  assert "_contrastive" not in methods and not any(name.startswith("_") for name in methods)
  evaluators = modules.available("evaluators")
  assert {"linear_probe", "voc07_svm", "zero_shot"} <= set(evaluators)
  helpers = {"inputs", "_inputs", "caption_metrics", "_caption_metrics", "_linear_svm", "_vl_metrics"}
  assert not helpers & set(evaluators)
  builders = modules.available("data.builders")
  assert {"synthetic_scenes", "coco_captions2017", "vqa2", "mm_imdb"} <= set(builders)
  assert not {"_vl_datasets", "common", "scenes"} & set(builders)


@pytest.mark.parametrize("name", ["nope", "_contrastive", "clip.Method", "../clip", "", None, 3])
def test_an_unknown_name_is_the_users_error_listing_the_known(name):
  with pytest.raises(UserError, match=f"^Unknown method {re.escape(repr(name))}. Known: classifier, clip, icmlm"):
    modules.get("methods", name, "method")


def test_a_kind_that_is_no_package_is_a_programming_error():
  with pytest.raises(ValueError, match="kind='no/such'"):
    modules.available("no/such")
  with pytest.raises(ModuleNotFoundError):
    modules.available("no_such_kind")


def test_own_imports_a_dotted_path_and_names_what_is_missing(tmp_path, monkeypatch):
  assert modules.own("vlrep.methods.clip", "method.name").__name__ == "vlrep.methods.clip"
  with pytest.raises(UserError, match=r"method.name='no_such_pkg.mod': no module 'no_such_pkg' on the Python path"):
    modules.own("no_such_pkg.mod", "method.name")
  with pytest.raises(UserError, match=r"method.name='a..b' is not a module's dotted path"):
    modules.own("a..b", "method.name")
  # A module the user's module imports that is missing stays that module's own error (a traceback to fix it by).
  (tmp_path / "h3_own_module_needing_more.py").write_text("import no_such_dependency_h3\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ModuleNotFoundError, match="no_such_dependency_h3") as e:
    modules.own("h3_own_module_needing_more", "method.name")
  assert not isinstance(e.value, UserError)


def test_listing_and_getting_from_many_threads_at_once():
  """The lookup this replaced parsed source files with `ast.parse`, which CPython 3.11 failed from several threads
  at once (a lock was needed); listing reads folder names and getting is an import, both safe from threads."""
  expected = {kind: modules.available(kind) for kind in ("methods", "evaluators", "data.builders")}

  def look_up(i):
    kind = ("methods", "evaluators")[i % 2]
    listed = modules.available(kind)
    name = listed[i % len(listed)]
    return kind, listed, modules.get(kind, name, kind).__name__ == f"vlrep.{kind}.{name}"

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(look_up, range(64)))
  assert all(listed == expected[kind] and got for kind, listed, got in results)
