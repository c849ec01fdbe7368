"""The repository stands alone: its docs and code cite only documents it contains.

A clone must be readable on its own: no reference to files outside it, every relative
link of the Markdown docs (and its #anchor) resolves, and every `*.md` file the sources
name exists in the repository.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = [
    "README.md",
    "Makefile",
    "setup.py",
    "docs",
    "megatron_rl",
    "megatron_rl_lab",
    "tools",
    "examples",
    "scripts",
    ".ci",
    "tests",
]
OUTSIDE = ".." + "/shared"  # spelled in two parts so this file does not match itself
MARKDOWN = [REPO / "README.md", REPO / "scripts" / "slurm" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MD_NAME = re.compile(r"[\w./-]*\w\.md\b")


def _text_files():
    for entry in SCANNED:
        path = REPO / entry
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            if "__pycache__" in file.parts:
                continue
            try:
                yield file, file.read_text(encoding="utf-8")
            except UnicodeDecodeError:  # images, weights
                continue


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    headings = re.findall(r"^#+\s+(.*)$", markdown.read_text(encoding="utf-8"), flags=re.M)
    return {_slug(h) for h in headings}


def test_nothing_refers_outside_the_repository():
    offenders = [
        f"{_rel(f)}:{n}" for f, text in _text_files() for n, line in enumerate(text.splitlines(), 1) if OUTSIDE in line
    ]
    assert not offenders, f"references to {OUTSIDE}: {offenders}"


@pytest.mark.parametrize("markdown", MARKDOWN, ids=_rel)
def test_relative_links_resolve(markdown):
    broken = []
    for target in LINK.findall(markdown.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (markdown.parent / path).resolve() if path else markdown
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
        elif REPO not in file.parents and file != REPO:
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{_rel(markdown)}: {broken}"


def test_cited_markdown_files_exist():
    missing = []
    for file, text in _text_files():
        for name in set(MD_NAME.findall(text)):
            candidates = [REPO / name, file.parent / name, REPO / "docs" / name]
            if not any(c.is_file() for c in candidates):
                missing.append(f"{_rel(file)}: {name}")
    assert not missing, f"cited Markdown files that are not in the repository: {sorted(missing)}"
