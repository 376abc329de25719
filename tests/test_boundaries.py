"""The research library never imports the platform's dependencies (docs/architecture.md, three
layers), and no module of either imports itself around a circle."""

import subprocess
import sys
from pathlib import Path


def test_importing_icr_imports_no_ray_optuna_mlflow_or_studies():
    code = (
        "import pkgutil, importlib, sys, icr\n"
        "for m in pkgutil.walk_packages(icr.__path__, 'icr.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in {'ray', 'optuna', 'mlflow', 'studies'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_torchvision_is_imported_only_where_a_resnet_is_built():
    """Importing torchvision imports all of it, torch._dynamo included (1.5 to 3.9 CPU seconds on
    these machines): no module of the library or the platform imports it, so the command line,
    the driver and every trial's process start without it (benchmarks/process_start.py); random
    erasing is the project's own (icr.data.images) and the ResNet builders import it when
    called."""
    code = (
        "import pkgutil, importlib, sys, icr, studies, torch\n"
        "for package in (icr, studies):\n"
        "    for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "print('torchvision' in sys.modules, 'torch._dynamo' in sys.modules)\n"
        "from icr.data.images import erase\n"
        "erased = erase(torch.ones(1, 3, 16, 16), torch.tensor([[2, 3, 4, 5]]))\n"
        "print('torchvision' in sys.modules, bool((erased == 0).any()), bool((erased == 1).any()))\n"
        "from icr.models.image import resnet18\n"
        "resnet18()\n"
        "print('torchvision' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False", "True", "True", "True"]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, read from the source: imports inside
    functions included (they still run, only later), ``if TYPE_CHECKING:`` blocks excluded
    (they never run), and a module's import of ``a.b.c`` counting ``a.b``'s package too (its
    ``__init__`` runs first), unless the importer lives inside that package."""
    import ast

    root = Path(__file__).resolve().parents[1]
    modules = {}
    for package in ("icr", "studies"):
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                   and ast.unparse(guard.test).endswith("TYPE_CHECKING")
                   for statement in guard.body for node in ast.walk(statement)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                            for a in node.names}
        edges = set()
        for target in filter(None, map(known, targets)):
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                parent = ".".join(parts[:k])
                if parent in modules and parent != name and not name.startswith(parent + "."):
                    edges.add(parent)
        graph[name] = edges
    return graph


def test_no_import_circle_in_the_library_or_the_platform():
    """Every cycle of imports among icr and studies modules, hidden inside a function or not."""
    graph = _import_graph()
    assert graph["icr.train.loop"] >= {"icr.train.tasks", "icr.analysis"}  # the reader reads
    index: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:  # depth-first: a back edge is a cycle
        index[node] = len(path)
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in index:
                visit(nxt, path)
        path.pop()

    for module in sorted(graph):
        if module not in index:
            visit(module, [])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


LAZY = "# lazy:"  # how an import inside a function says why it is there


def _bare_imports_inside_functions(root: Path) -> list[str]:
    """``path:line: statement`` of each import inside a function (of icr and studies) that has
    no comment starting with ``# lazy:`` and giving a reason, on its line or the line above."""
    import ast
    import io
    import tokenize

    def gives_reason(comment: str) -> bool:
        return comment.startswith(LAZY) and bool(comment[len(LAZY):].strip())

    bare = []
    for package in ("icr", "studies"):
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            lines = source.splitlines()
            comments = {token.start[0]: token.string for token in
                        tokenize.generate_tokens(io.StringIO(source).readline)
                        if token.type == tokenize.COMMENT}
            inside = {node.lineno for function in ast.walk(ast.parse(source))
                      if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
                      for node in ast.walk(function) if isinstance(node, ast.Import | ast.ImportFrom)}
            for number in sorted(inside):
                own = comments.get(number, "")
                above = lines[number - 2].strip() if number > 1 else ""
                if not gives_reason(own) and not (above.startswith("#") and gives_reason(above)):
                    bare.append(f"{path.relative_to(root)}:{number}: {lines[number - 1].strip()}")
    return bare


def test_an_import_inside_a_function_says_why_it_is_not_at_the_top():
    """An import inside a function hides a dependency of its module from a reader (two import
    circles once hid that way): it stays only where it keeps a heavy dependency (torch,
    transformers, matplotlib, Ray, MLflow, ...) off a light path, such as the command line's
    start or a trial's, and says so: ``# lazy: keeps matplotlib off ...`` on its line or the
    line above. Every other import belongs at the top of its module."""
    bare = _bare_imports_inside_functions(Path(__file__).resolve().parents[1])
    assert not bare, (f"{len(bare)} import(s) inside a function without a '{LAZY} <reason>' "
                      "comment (move each to the top of its module, or say why it waits):\n"
                      + "\n".join(bare))


def test_the_lazy_import_check_reads_the_comment_on_the_line_or_above(tmp_path):
    """The check itself: a reason on the line or directly above passes; none, an empty one, or
    one two lines above does not; imports at a module's top are not its business."""
    (tmp_path / "icr").mkdir()
    (tmp_path / "studies").mkdir()
    (tmp_path / "icr" / "m.py").write_text(
        "import os\n"
        "def f():\n"
        "    import json  # lazy: a reason\n"
        "    # lazy: a reason\n"
        "    import csv\n"
        "    import re\n"
        "    import ast  # lazy:\n"
        "    # lazy: too far\n"
        "\n"
        "    import io\n"
        "    def g():\n"
        "        import abc  # not lazy: a comment of another kind\n"
    )
    assert _bare_imports_inside_functions(tmp_path) == [
        "icr/m.py:6: import re", "icr/m.py:7: import ast  # lazy:", "icr/m.py:10: import io",
        "icr/m.py:12: import abc  # not lazy: a comment of another kind"]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_data_layer_and_the_context_know_no_model_metric_or_task():
    """icr.data and icr.context sit below the models, the metrics and the tasks: what a model
    reads is decided by its task (icr.train.retrieval_data, icr.grounding.train), and a task's own
    payload types live beside it, so a new task edits neither layer."""
    graph = _import_graph()
    above = ("icr.models", "icr.metrics", "icr.losses", "icr.objectives", "icr.train",
             "icr.grounding", "icr.analysis")
    low = [m for m in graph if m == "icr.context" or m.startswith("icr.data")]
    assert "icr.data.pipeline" in low and "icr.data.datasets" in low
    reached = {m: sorted(n for n in _reachable(graph, m) if n.startswith(above)) for m in low}
    assert not any(reached.values()), {m: r for m, r in reached.items() if r}


def test_the_context_names_no_tasks_type_not_even_for_type_checking():
    """A capability that carries a task's own data (RetrievalInputs, GroundingInputs) lives
    beside its task: icr.context, which the lowest data module imports, names only the config
    and the errors, in annotations too (a task's payload type there closed a circle of types)."""
    import ast

    path = Path(__file__).resolve().parents[1] / "icr" / "context.py"
    named = {node.module for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("icr")}
    assert named <= {"icr.config", "icr.errors"}, sorted(named)
