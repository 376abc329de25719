"""Ray, Tune, Optuna and MLflow through their public APIs; their internals only in their adapters.

docs/architecture.md, "Frameworks": whatever must touch a framework's internals or depends on its version lives in
``studies/frameworks/`` (one module per framework, with the version it was tested against).
This test reads every module of the project (``icr``, ``studies``, ``benchmarks``, ``tests``)
outside that package and the adapters' own tests (``tests/test_frameworks_*.py``) and finds:

- an import of a private module or name of a framework (``ray._private``, ``from ray.train._internal
  import ...``, ``from mlflow.x import _y``);
- a string naming one (a script or a logger name such as ``"ray.train._internal.syncer"``);
- a private attribute (``obj._name``) that the project itself defines nowhere, so it belongs to a
  library's object (``client._tracking_client``, ``OptunaSearch._ot_trials``).

Inside the adapters, the internals they touch are listed (``EXPECTED_TOUCHES``, found by
:func:`internal_touches`), so that a new one is a visible change, and docs/architecture.md's table
names each.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("ray", "mlflow", "optuna")
PRIVATE_PATH = re.compile(r"\b(?:" + "|".join(FRAMEWORKS) + r")(?:\.\w+)*\._\w")
# Private names of other libraries that the project may use (not frameworks of the adapters).
ALLOWED = {
    "_BatchNorm": "torch.nn's base class of every BatchNorm layer (isinstance checks)",
    "_exit": "os._exit, the standard library's documented exit without cleanup handlers",
    "_dynamo": "torch._dynamo.explain and its config: the graph-break report, which "
               "torch.compiler does not expose (tests/test_graphs.py)",
}


def _modules() -> list[Path]:
    return sorted(p for folder in ("icr", "studies", "benchmarks", "tests")
                  for p in (ROOT / folder).rglob("*.py"))


def _scanned() -> list[Path]:
    return [p for p in _modules() if "frameworks" not in p.relative_to(ROOT).parts
            and not p.name.startswith("test_frameworks")]


def _defined_names() -> set[str]:
    """Every name the project binds anywhere: its own private names are its own business."""
    names: set[str] = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_access(path: Path, own: set[str]) -> list[str]:
    """Where ``path`` reaches into a framework's internals: ``line: what`` each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
            for module in modules:
                parts = module.split(".")
                if parts[0] in FRAMEWORKS and any(_private(p) for p in parts[1:]):
                    found.append(f"{node.lineno}: import of {module}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FRAMEWORKS:
                found += [f"{node.lineno}: import of {node.module}.{a.name}"
                          for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if PRIVATE_PATH.search(node.value):
                found.append(f"{node.lineno}: names {PRIVATE_PATH.search(node.value).group(0)}...")
        elif (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
              and node.attr not in ALLOWED):
            found.append(f"{node.lineno}: attribute .{node.attr}")
    return found


def test_no_private_framework_access_outside_the_adapters() -> None:
    own = _defined_names()
    found = {str(p.relative_to(ROOT)): private_access(p, own) for p in _scanned()}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The three kinds of access, on a module written to hold one of each."""
    module = tmp_path / "bad.py"
    module.write_text(
        "from ray._private import services\n"
        "from mlflow.store.tracking import _helper\n"
        "LOGGER = 'ray.train._internal.syncer'\n"
        "def f(client):\n"
        "    return client._tracking_client\n")
    found = private_access(module, own=set())
    assert [line.split(":")[0] for line in found] == ["1", "2", "3", "5"], found


def declared() -> list[str]:
    """The requirements of pyproject.toml's ``[project] dependencies`` list, as written."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return re.findall(r'^\s*"([^"]+)"', block, re.M)


def distribution(requirement: str) -> str:
    """``ray[tune,default]>=2.56`` -> ``ray``: the distribution's normalised name."""
    return re.split(r"[\[=<>~!; ]", requirement)[0].lower().replace("_", "-")


def declared_range(name: str) -> SpecifierSet:
    """The versions pyproject.toml declares for distribution ``name``."""
    (requirement,) = [Requirement(r) for r in declared() if distribution(r) == name]
    return requirement.specifier


def locked() -> dict[str, str]:
    """constraints.txt, the lock that ``make install`` and CI install: distribution -> version."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return {distribution(line): line.partition("==")[2].strip()
            for line in lines if line and not line.startswith("#")}


@pytest.mark.parametrize("name", ["ray", "mlflow", "optuna"])
def test_each_framework_is_a_tested_range_and_the_lock_pins_one_version_in_it(name) -> None:
    """pyproject.toml declares a range (a lower and an upper end, both run: docs/architecture.md,
    "Frameworks"); the lock pins one version inside it, and the installed one is inside too."""
    import importlib.metadata

    versions = declared_range(name)
    assert {s.operator for s in versions} == {">=", "<="}, (
        f"pyproject.toml must declare {name} as >=LOWEST,<=NEWEST (the versions tested), "
        f"not {versions}")
    assert locked()[name] in versions, f"constraints.txt locks {name} outside {versions}"
    installed = importlib.metadata.version(name)
    assert installed in versions, f"{name} {installed} is installed, outside {versions}"


@pytest.mark.parametrize("framework,name", [("ray", "ray"), ("tune", "ray"), ("optuna", "optuna")])
def test_an_adapter_names_the_locked_version_it_was_written_for(framework, name) -> None:
    """An adapter that reaches internals names the version they were read from: the lock's (its
    errors tell the user to install it)."""
    import importlib

    adapter = importlib.import_module(f"studies.frameworks.{framework}")
    assert locked()[name] == adapter.TESTED_VERSION, (
        f"studies/frameworks/{framework}.py names {adapter.TESTED_VERSION}, constraints.txt "
        f"locks {name}=={locked()[name]}: rerun the tests and update one of them")


def test_the_lock_holds_every_declared_dependency() -> None:
    names = {distribution(r) for r in declared()}
    assert len(names) > 10 and names - set(locked()) == set()


def test_every_declared_dependency_is_imported() -> None:
    """A dependency of pyproject.toml is imported by the library or the platform (a distribution
    is matched to the top-level names it installs); one that nothing imports goes."""
    import importlib.metadata

    imported: set[str] = set()
    for path in (p for folder in ("icr", "studies") for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    providers = importlib.metadata.packages_distributions()
    used = {dist.lower().replace("_", "-") for name in imported for dist in providers.get(name, ())}
    names = {distribution(r) for r in declared()}
    assert len(names) > 10 and "torch" in names  # the list was read
    assert names - used == set(), f"declared in pyproject.toml, imported nowhere: {names - used}"


def test_an_internal_that_moved_is_one_line_naming_both_versions(monkeypatch) -> None:
    """The adapter reaches for Ray's internals when it is imported: one that is gone is one
    line naming the installed and the tested version, before the platform uses any."""
    import importlib
    import sys

    from studies.frameworks import FrameworkChanged
    from studies.frameworks import ray as ray_internals

    monkeypatch.setitem(sys.modules, "ray._private.ray_constants", None)  # as if it were gone
    try:
        with pytest.raises(FrameworkChanged) as error:
            importlib.reload(ray_internals)
    finally:
        monkeypatch.undo()
        importlib.reload(ray_internals)  # whole again for the tests that follow
    message = str(error.value)
    assert "\n" not in message and ray_internals.TESTED_VERSION in message
    assert "ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS has changed" in message


# --- the internals the adapters touch: listed, so that a new one is a visible change ------------

ADAPTERS = ROOT / "studies" / "frameworks"
# The frameworks' modules whose names the adapters may import as public API (each in its
# framework's API reference); a name from any other module of a framework is an internal.
PUBLIC_MODULES = {
    "ray", "ray.tune", "ray.tune.error", "ray.tune.logger", "ray.tune.search",
    "ray.tune.schedulers", "ray.util.state",
    "optuna", "optuna.distributions", "optuna.samplers", "optuna.storages", "optuna.study",
    "optuna.trial",
    "mlflow", "mlflow.entities", "mlflow.tracking",
}
# Framework classes documented as extension points: a subclass implements their interface.
EXTENSION_POINTS = {"BaseSampler", "Callback", "Searcher", "LoggerCallback"}
# What each adapter touches that is not its framework's public API, as internal_touches finds it.
# docs/architecture.md, "Frameworks", says of each why and what public API would replace it; a
# touch added or removed fails test_the_adapters_touch_exactly_the_listed_internals until this
# list (and that table) says so.
EXPECTED_TOUCHES = {
    "mlflow.py": [],
    "optuna.py": [],
    "ray.py": [
        "import of ray._private.authentication.authentication_token_setup",
        "import of ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS",
        "import of ray._private.services",
        "import of ray.autoscaler.v2.sdk.get_cluster_status",
        "import of ray.autoscaler.v2.utils.is_autoscaler_v2",
        "import of ray.experimental.internal_kv._internal_kv_get",
        "names autoscaler/_private/monitor.py",
        "names ray._private.services",
    ],
    "tune.py": [
        "attribute ._setup_trial",
        "class EpochCsvLogger(CSVLoggerCallback) defines __init__, _last_epoch, _open, "
        "log_trial_end, log_trial_result, log_trial_start",
        "class EpochJsonLogger(JsonLoggerCallback) defines __init__, _last_epoch, _open, "
        "log_trial_end, log_trial_result, log_trial_start",
        "class LabelledTrial(wrap_function()) defines __repr__, restore",
        "import of ray.tune.trainable.function_trainable.wrap_function",
        "names ray.train._internal.syncer",
    ],
}


NAMED = re.compile(r"\b(?:" + "|".join(FRAMEWORKS) + r")(?:[./]\w+)+(?:\.py)?")


def _framework_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it is, for every name bound to a framework's object: an import
    (``GridSampler`` -> ``GridSampler``), or the result of calling one
    (``base = wrap_function(fn)`` -> ``wrap_function()``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FRAMEWORKS:
            names.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names
                          if a.name.split(".")[0] in FRAMEWORKS})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id in names):
            names.update({t.id: f"{names[node.value.func.id]}()" for t in node.targets
                          if isinstance(t, ast.Name)})
    return names


def _internal_module(module: str) -> bool:
    return module not in PUBLIC_MODULES or any(_private(p) for p in module.split("."))


def _labels(tree: ast.Module) -> set[int]:
    """The ids of the strings that only label a touch: the first argument of ``_reaching``."""
    return {id(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ast.unparse(node.func) == "_reaching" and node.args}


def internal_touches(path: Path) -> list[str]:
    """What the module at ``path`` touches of a framework that is not its public API, sorted:

    - a name imported from a framework's private module or from one outside
      :data:`PUBLIC_MODULES`, or a private name imported from any;
    - a private attribute (``study._storage``) that the module itself does not define;
    - a string naming a private module or file of a framework (a script that ``ray start`` runs,
      a logger's name, an autoscaler's command line), not counting the labels of ``_reaching``;
    - a class derived from a framework's class that is not one of :data:`EXTENSION_POINTS`,
      with the methods it (or a mixin of this module before it) defines.
    """
    tree = ast.parse(path.read_text())
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
           and isinstance(n.ctx, ast.Store)} | {
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    labels = _labels(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FRAMEWORKS:
            found.update(f"import of {node.module}.{a.name}" for a in node.names
                         if _internal_module(node.module) or _private(a.name))
        elif isinstance(node, ast.Import):
            found.update(f"import of {a.name}" for a in node.names
                         if a.name.split(".")[0] in FRAMEWORKS and _internal_module(a.name))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            found.add(f"attribute .{node.attr}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in labels):
            found.update(f"names {m}" for m in NAMED.findall(node.value)
                         if any(_private(p) for p in re.split(r"[./]", m)))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join":
            parts = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if any(_private(p) for p in parts):
                found.add("names " + "/".join(parts))
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    names = _framework_names(tree)
    for node in classes.values():
        bases = [ast.unparse(b) for b in node.bases]
        framework = [names[b] for b in bases if b in names]
        if not framework or all(f in EXTENSION_POINTS for f in framework):
            continue
        methods = {m.name for c in [node, *(classes[b] for b in bases if b in classes)]
                   for m in c.body if isinstance(m, ast.FunctionDef)}
        found.add(f"class {node.name}({', '.join(framework)}) defines "
                  f"{', '.join(sorted(methods))}")
    return sorted(found)


def test_the_adapters_touch_exactly_the_listed_internals() -> None:
    found = {p.name: internal_touches(p) for p in sorted(ADAPTERS.glob("*.py"))
             if p.name != "__init__.py"}
    assert found == EXPECTED_TOUCHES


def test_the_scan_finds_each_kind_of_internal_touch(tmp_path: Path) -> None:
    """One of each kind the adapters' list is made of, and public API that is none."""
    module = tmp_path / "adapter.py"
    module.write_text(
        "import os\n"
        "import optuna\n"
        "from optuna.samplers import BaseSampler, GridSampler\n"
        "from ray._private import services\n"
        "from ray.tune.result import AUTO_RESULT_KEYS\n"
        "SCRIPT = 'import ray._private.services'\n"
        "MONITOR = os.path.join('autoscaler', '_private', 'monitor.py')\n"
        "def f(study):\n"
        "    return study._storage, optuna.create_study()\n"
        "class Once(GridSampler):\n"
        "    def after_trial(self, *args):\n"
        "        return None\n"
        "class Mine(BaseSampler):\n"
        "    def sample_relative(self, *args):\n"
        "        return {}\n")
    assert internal_touches(module) == [
        "attribute ._storage", "class Once(GridSampler) defines after_trial",
        "import of ray._private.services", "import of ray.tune.result.AUTO_RESULT_KEYS",
        "names autoscaler/_private/monitor.py", "names ray._private.services"]


def test_docs_architecture_names_every_listed_touch() -> None:
    """docs/architecture.md's "Frameworks" table has a row for each touch of the list (why, and
    what public API would replace it)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## Frameworks")
    frameworks = text[start:text.index("\n## ", start + 1)]
    names = [touch.split(" ")[2] if touch.startswith("import of") else
             touch.split(" ")[1] if touch.startswith(("attribute", "names")) else
             touch.split(" ")[1].split("(")[0]
             for touches in EXPECTED_TOUCHES.values() for touch in touches]
    assert len(names) > 10
    assert [n for n in names if n not in frameworks] == []
