"""The documentation stands on its own: README is short, every relative link and every "docs/design.md
section N" citation resolves inside the repository, nothing points at a file outside it, the user-facing text
cites no issue numbers, and the results table is the benchmarks' own output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE = [
    p
    for folder in ("runtime", "passes", "speccompile", "benchmarks", "tests", "models")
    for p in sorted((REPO / folder).rglob("*.py"))
    if p.name != "test_docs.py"
]


def sections() -> set[str]:
    return set(re.findall(r"^## (\d+)\.", (REPO / "docs" / "design.md").read_text(), re.M))


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 300


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_design_citations_resolve_inside_the_repository():
    known, bad = sections(), []
    for path in DOCS + CODE:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "../shared" in line or "shared/DESIGN.md" in line:
                bad.append(f"{path.relative_to(REPO)}:{number}: points outside the repository")
            for cited in re.findall(r"(?:docs/)?design\.md sections? (\d+)", line, re.I):
                if cited not in known:
                    bad.append(f"{path.relative_to(REPO)}:{number}: section {cited} does not exist")
            if re.search(r"(?<!docs/)DESIGN\.md", line):
                bad.append(f"{path.relative_to(REPO)}:{number}: cites DESIGN.md, not docs/design.md")
    assert not bad, "\n".join(bad)


def test_user_docs_cite_no_issue_numbers():
    bad = [
        f"{doc.relative_to(REPO)}:{n}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if re.search(r"\bissues? #?\d+", line, re.I)
    ]
    assert not bad, bad


def test_the_results_table_is_generated():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "render_results.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
