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
