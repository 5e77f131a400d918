"""README is the front door: short, CI's test command as .ci/run runs it at the very top, a map naming every module
and package of vlrep/ on its layer (the layers tests/test_architecture.py enforces), and links that lead somewhere.
Everything else lives in docs/, so the checks are on README's shape, not its prose."""

import glob
import os
import re

from conftest import ROOT
from test_architecture import LAYERS, layer_of

README = os.path.join(ROOT, "README.md")
MAX_LINES = 250


def read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def code_blocks(text: str) -> list[tuple[int, str]]:
  """(line number of the opening fence, body) of each fenced block."""
  fences = re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
  return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in fences]


def ci_test_command() -> str:
  """The line of .ci/run that installs vlrep and runs the tests: README must show exactly this."""
  lines = [line.strip() for line in read(os.path.join(ROOT, ".ci", "run")).splitlines()]
  (command,) = [line for line in lines if line.startswith("pip install") and "pytest" in line]
  return command


def test_readme_is_a_front_door_of_at_most_250_lines():
  lines = read(README).splitlines()
  assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (at most {MAX_LINES})"


def test_the_first_commands_are_the_quick_start_and_ci_test_command():
  first_line, first = code_blocks(read(README))[0]
  assert first_line <= 15, "the quick start's commands are README's first block, at the very top"
  commands = [line for line in first.splitlines() if line and not line.startswith("#")]
  assert commands == [
    "pip install -e . && python -m vlrep.main --config=configs/virtex.py:runlocal --workdir=/tmp/vlrep_virtex_local",
    ci_test_command(),
  ]


def root_entries(package_dir: str) -> set[str]:
  """`name.py` for each module and `name/` for each package directly in the package (its __init__ aside)."""
  out = set()
  for name in os.listdir(package_dir):
    path = os.path.join(package_dir, name)
    if name.endswith(".py") and name != "__init__.py":
      out.add(name)
    elif os.path.isfile(os.path.join(path, "__init__.py")):
      out.add(name + "/")
  return out


def map_entries(readme: str) -> dict[str, int]:
  """{`name.py` or `name/` (subpackages as `a/b/`): layer} from the map block under README's "## Architecture"."""
  section = readme.split("\n## Architecture\n", 1)[1]
  _, block = code_blocks(section)[0]
  return {m.group(2): int(m.group(1)) for m in re.finditer(r"^(\d) +(\S+)", block, re.M)}


def map_errors(readme: str, package_dir: str) -> list[str]:
  """What README's map gets wrong about the package: a module or package missing or gone, or on another layer than
  test_architecture.LAYERS puts it."""
  entries = map_entries(readme)
  mapped, present = {e for e in entries if "/" not in e.rstrip("/")}, root_entries(package_dir)
  errors = [f"not on the map: {e}" for e in sorted(present - mapped)]
  errors += [f"on the map, not in vlrep/: {e}" for e in sorted(mapped - present)]
  errors += [
    f"on the map, not in vlrep/: {e}"
    for e in sorted(set(entries) - mapped)
    if not os.path.exists(os.path.join(package_dir, e))
  ]
  for entry, layer in sorted(entries.items()):
    module = "vlrep." + entry.removesuffix(".py").removesuffix("/").replace("/", ".")
    if layer_of(module) != layer:
      errors.append(f"{entry} on layer {layer}, test_architecture.LAYERS says {layer_of(module)}")
  return errors


def test_the_map_names_every_module_and_package_of_vlrep_on_its_layer():
  readme = read(README)
  assert map_errors(readme, os.path.join(ROOT, "vlrep")) == []
  assert set(map_entries(readme).values()) == set(LAYERS.values())
  # The check sees a module left off the map and one placed on the wrong layer.
  crafted = readme.replace("\n2 decoding.py ", "\n1 decoding.py ").replace("\n0 errors.py ", "\n0 mistakes.py ")
  crafted = crafted.replace("\n3 interop/formats/ ", "\n3 interop/shapes/ ")
  assert map_errors(crafted, os.path.join(ROOT, "vlrep")) == [
    "not on the map: errors.py",
    "on the map, not in vlrep/: mistakes.py",
    "on the map, not in vlrep/: interop/shapes/",
    "decoding.py on layer 1, test_architecture.LAYERS says 2",
    "interop/shapes/ on layer 3, test_architecture.LAYERS says 4",
    "mistakes.py on layer 0, test_architecture.LAYERS says None",
  ]


def broken_links(root: str) -> list[str]:
  """Relative links in README.md and docs/**/*.md (outside code blocks) whose file does not exist."""
  broken = []
  docs = sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
  for path in [os.path.join(root, "README.md"), *docs]:
    text = re.sub(r"^```.*?^```", "", read(path), flags=re.M | re.S)
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      if not os.path.exists(os.path.join(os.path.dirname(path), target.split("#")[0])):
        broken.append(f"{os.path.relpath(path, root)}: {target}")
  return broken


def test_every_relative_link_in_readme_and_docs_leads_to_a_file(tmp_path):
  assert broken_links(ROOT) == []
  # The check sees a link to a file that is not there, and follows one that is, relative to its page.
  (tmp_path / "docs" / "results").mkdir(parents=True)
  (tmp_path / "README.md").write_text("[a](docs/a.md) [b](docs/gone.md) [web](https://x.org/y) [top](#quick-start)\n")
  (tmp_path / "docs" / "a.md").write_text("[up](../README.md#x)\n```\n[in code](nowhere.md)\n```\n")
  (tmp_path / "docs" / "results" / "r.md").write_text("[a](../a.md) [c](c.md)\n")
  assert broken_links(str(tmp_path)) == ["README.md: docs/gone.md", "docs/results/r.md: c.md"]
