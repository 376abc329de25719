"""Every document the project cites ships with it.

A clone holds the code, README.md and docs/; the notes, the design and the papers' texts its
authors worked from do not come with it. So a docstring or comment may cite a document only if
it is in the repository, and the README's and docs' links and the repository paths they name
must lead somewhere.
"""

from __future__ import annotations

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
