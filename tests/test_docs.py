"""Every document the project cites ships with it.

A clone holds the code, README.md and docs/; the notes, the design and the papers' texts its
authors worked from do not come with it. So a docstring or comment may cite a document only if
it is in the repository, and the README's and docs' links and the repository paths they name
must lead somewhere.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()

# Documents of the authors' workspace that a clone does not have: their notes, design, style guide,
# machine notes and the papers' texts (cite a paper by authors, venue, section and equation).
OUTSIDE = re.compile(r"REFERENCE_NOTES|\bDESIGN\.md|\bSTYLE\.md|\bDEVICE\.md|\bpapers/[\w.*-]+\.txt|\.\./shared/")
# A document: a page of docs/ or an upper-case name (README.md); a report's table.md is an output.
CITED_DOC = re.compile(r"(?<![\w/.-])(docs/[\w-]+\.md|[A-Z][A-Z_]+\.md)\b")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:icr|studies|tests|benchmarks|search_spaces|docs)/[\w/.-]+\.(?:py|yaml|sh|md))\b")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every file on disk
        return sorted(p for pattern in patterns for p in ROOT.glob(pattern) if p.is_file())
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def text_files() -> list[Path]:
    files = tracked("*.py", "*.yaml", "*.sh", "*.md", "*.toml", "Makefile", ".ci/*")
    return [f for f in files if f.resolve() != THIS and "fixtures" not in f.parts]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")}


def test_no_file_cites_a_document_a_clone_lacks():
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for f in text_files() for n, line in enumerate(f.read_text().splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "cites a document outside the repository:\n" + "\n".join(found)


def test_every_cited_markdown_document_exists():
    missing = []
    for f in text_files():
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for name in CITED_DOC.findall(line):
                candidates = [ROOT / name, f.parent / name]
                if not any(c.is_file() for c in candidates):
                    missing.append(f"{f.relative_to(ROOT)}:{n}: {name}")
    assert not missing, "cites a Markdown document that is not in the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", documents(), ids=lambda d: d.name)
def test_links_and_paths_in_the_docs_lead_somewhere(doc):
    broken = []
    text = doc.read_text()
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"link {target}: no file {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"link {target}: no heading #{anchor} in {dest.name}")
    for path in REPO_PATH.findall(text):
        if not (ROOT / path).exists():
            broken.append(f"path {path}: not in the repository")
    assert not broken, f"{doc.name}:\n" + "\n".join(broken)


def test_the_documentation_index_lists_every_document():
    readme = (ROOT / "README.md").read_text()
    unlisted = [d.name for d in documents()[1:] if f"](docs/{d.name})" not in readme]
    assert not unlisted, f"README.md links none of: {unlisted}"


def test_a_broken_link_and_a_missing_document_are_caught(tmp_path):
    """The checks themselves: a link to a missing heading, and a slug as GitHub makes it."""
    doc = tmp_path / "a.md"
    doc.write_text("# Running studies: `--plan`\n\nSee [x](#nowhere) and [y](#running-studies---plan).\n")
    assert slug("Running studies: `--plan`") == "running-studies---plan"
    assert "running-studies---plan" in anchors(doc)
    assert "nowhere" not in anchors(doc)
    assert OUTSIDE.search("see REFERENCE_NOTES.md section 1") and OUTSIDE.search("(papers/x-y.txt)")
    assert not OUTSIDE.search("the ECIR code's shared/losses.py")
    assert CITED_DOC.findall("see docs/gpu.md, DESIGN.md and table1_vs_baseline.md") == ["docs/gpu.md", "DESIGN.md"]


# --- the code maps and the trial's path -------------------------------------------------------
#
# README.md and docs/architecture.md each draw the code as a map (the fenced block under "## The
# code"): a top-level folder per line at column 0, its modules and packages at column 2, and in
# the descriptions further module names (``trainable.py: ...``, ``ray.py, tune.py``). Every name
# a map gives must exist. docs/architecture.md's "## The trial's path" lists the hops from the
# command line to an MLflow metric, each ``N. `from.py: function` → `to.py: function` ...``
# (or ``Tune ... → `to.py: function```, where the framework carries the call across a process).
# What the path is, for these tests: the modules its references name (hops and what is named
# beside them) and everything of icr/ and studies/ that those import, directly or through each
# other, at any depth (lazy imports too): what runs, or is loaded, when a trial runs. The
# architecture's map must hold each of those (as its module, or its top-level package: `data/`
# for icr/data/batches.py), and README's short map each module a hop leaves from or lands in.
# Import closure rather than a hand-kept list, so that a module added to the path (say by a
# refactor that splits one) is caught without editing this test.

CODE_PACKAGES = ("icr", "studies")
REF = re.compile(r"`((?:icr|studies)/[\w/]+\.py): ([\w.]+)`")
HOP = re.compile(r"^(\d+)\. (.*?) → `((?:icr|studies)/[\w/]+\.py): ([\w.]+)`", re.S)
NUMBERS = {w: i for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six",
                                       "seven", "eight", "nine", "ten", "eleven", "twelve"))}


def section(doc: Path, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of that level."""
    text = doc.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def code_map(doc: Path) -> dict[str, list[str]]:
    """What a document's code map names: repository path -> the names that stand for it (a line's
    entry, or a module named in a description). A name is resolved in the entry's folder, then
    in its parent's; one that is in neither keeps the entry's folder (and cannot exist)."""
    block = section(doc, "The code").split("```")[1]
    named: dict[str, list[str]] = {}
    top = parent = ""
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        entry, _, description = line.strip().partition(" ")
        if not line.startswith(" "):
            top = parent = entry
        elif len(line) - len(line.lstrip()) == 2:
            parent = f"{top}{entry}"
        else:
            description = line  # a description's continuation
        if not line.startswith(" ") or len(line) - len(line.lstrip()) == 2:
            named.setdefault(parent.rstrip("/"), []).append(entry)
        for name in re.findall(r"(?<![\w/.])([a-z_]\w*\.py)\b", description):
            folders = [parent if parent.endswith("/") else parent.rsplit("/", 1)[0] + "/", top]
            path = next((f + name for f in folders if (ROOT / f / name).exists()), folders[0] + name)
            named.setdefault(path, []).append(name)
    return named


def unit(path: str) -> str:
    """A module's place in a code map: ``studies/tuning.py``, or its top-level package
    (``icr/data`` for ``icr/data/batches.py``, ``studies/frameworks`` for its modules)."""
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


def module_file(root: Path, dotted: str) -> Path | None:
    base = root / dotted.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(root: Path, path: Path) -> set[Path]:
    """The project modules (files under icr/ and studies/) that ``path`` imports anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for dotted in names:
            if dotted.split(".")[0] in CODE_PACKAGES:
                target = module_file(root, dotted)
                if target is not None:
                    found.add(target)
    return found


def import_closure(root: Path, start: set[Path]) -> set[Path]:
    seen, todo = set(), list(start)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imports_of(root, path) - seen)
    return seen


def path_references(root: Path) -> list[tuple[str, str]]:
    """Every ``file: name`` the trial's path of docs/architecture.md names."""
    return REF.findall(section(root / "docs" / "architecture.md", "The trial's path"))


def hops(root: Path) -> list[tuple[int, str, str, str]]:
    """The numbered hops of the trial's path: (number, where from, file, name it lands in)."""
    text = section(root / "docs" / "architecture.md", "The trial's path")
    items = re.split(r"\n(?=\d+\. )", text)[1:]
    out = []
    for item in items:
        match = HOP.match(item)
        assert match, f"a hop that does not say where it goes (`a.py: f` → `b.py: g`): {item[:80]}"
        out.append((int(match.group(1)), match.group(2), match.group(3), match.group(4)))
    return out


def defines(path: Path, dotted: str) -> bool:
    """Whether ``path`` defines ``dotted``: a function or class, a method (``Class.method``) or a
    function nested in one (``run_trial.reporter``)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for name in dotted.split("."):
        found = next((node for node in scope if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name), None)
        if found is None:
            return False
        scope = found.body
    return True


def map_problems(root: Path, doc: Path) -> list[str]:
    named = code_map(doc)
    return [f"{doc.name}: the code map names {' / '.join(names)} ({path}), which does not exist"
            for path, names in named.items() if not (root / path).exists()]


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_every_module_a_code_map_names_exists(doc):
    assert map_problems(ROOT, ROOT / doc) == []


def test_the_trial_s_path_is_hops_a_reader_can_follow():
    """Numbered hops, as many as the text counts (however many: the count is the code's, not
    a limit this test sets); each leaves from the command line's module or one an earlier hop
    reached (or from the framework that carries it across a process) and lands in a function
    that exists, as does every function named beside the hops."""
    found = hops(ROOT)
    assert [n for n, *_ in found] == list(range(1, len(found) + 1)) and found
    said = re.findall(r"\b(\w+) hops\b", section(ROOT / "docs" / "architecture.md", "The trial's path"))
    assert [int(w) if w.isdigit() else NUMBERS.get(w.lower()) for w in said] == [len(found)], said
    reached = {REF.search(found[0][1]).group(1)}  # where the path starts: the command line
    for number, origin, path, _ in found:
        source = REF.search(origin)
        if source is not None:
            assert number == 1 or source.group(1) in reached, f"hop {number} leaves from {source.group(1)}"
        else:
            assert re.match(r"(Tune|Ray|MLflow)\b", origin), f"hop {number} comes from nowhere: {origin}"
        reached.add(path)
    missing = [f"{path}: {name}" for path, name in path_references(ROOT)
               if not (ROOT / path).is_file() or not defines(ROOT / path, name)]
    assert missing == [], f"the trial's path names what the code does not hold: {missing}"


def path_coverage_problems(root: Path) -> list[str]:
    """What docs/architecture.md's map leaves out of the trial's path (see the comment above)."""
    start = {root / path for path, _ in path_references(root) if (root / path).is_file()}
    on_path = {unit(str(p.relative_to(root))) for p in import_closure(root, start)
               if p.name != "__init__.py" or p.parent.parent != root}
    return [f"docs/architecture.md's code map leaves out {u}, on the trial's path"
            for u in sorted(on_path) if u not in code_map(root / "docs" / "architecture.md")]


def test_the_architecture_s_code_map_holds_every_module_on_the_trial_s_path():
    assert path_coverage_problems(ROOT) == []


def test_the_readme_s_code_map_holds_every_module_a_hop_leaves_or_reaches():
    readme = {unit(p) for p in code_map(ROOT / "README.md")}
    ends = {unit(path) for _, _, path, _ in hops(ROOT)} | {
        unit(REF.search(origin).group(1)) for _, origin, _, _ in hops(ROOT) if REF.search(origin)}
    assert sorted(ends - readme) == [], "README.md's code map leaves out where these hops go"


def test_the_map_checks_catch_a_missing_module_and_a_left_out_one(tmp_path):
    """The checks themselves, on a copy of the project whose maps name a module that is not
    there and leave out one that a module on the path imports."""
    for folder in ("icr", "studies", "docs", "search_spaces", "benchmarks", "tests"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    readme = (ROOT / "README.md").read_text().replace(
        "  registry.py ", "  nowhere.py  gone; registry.py ", 1)
    (tmp_path / "README.md").write_text(readme)
    assert [p for p in map_problems(tmp_path, tmp_path / "README.md") if "nowhere.py" in p]
    docs = tmp_path / "docs"
    docs.unlink()
    docs.mkdir()
    (docs / "architecture.md").write_text(re.sub(r"\n  trials\.py .*", "",
                                                 (ROOT / "docs" / "architecture.md").read_text()))
    assert "docs/architecture.md's code map leaves out studies/trials.py, on the trial's path" \
        in path_coverage_problems(tmp_path)
