"""The documents name only what exists: files, tests, link targets and their headings."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = "tests|server|client|model|export|bench|loadtest|contract|deploy|monitoring|scripts|protos|docs"
# A repository path in backticks with a file extension or a closing slash, and optionally a test in it.
PATH = re.compile(rf"`((?:{PACKAGES})/[\w./-]*(?:\.\w+|/))(?:::(\w+))?`")
TEST_NAME = re.compile(r"`(test_\w+)`")
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)")


def documents() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@functools.cache
def defined_tests() -> frozenset[str]:
    sources = (path.read_text() for path in (ROOT / "tests").rglob("test_*.py"))
    return frozenset(name for source in sources for name in re.findall(r"def (test_\w+)", source))


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_test_and_link_a_document_names_exists(document: Path) -> None:
    text = document.read_text()
    missing = []
    for path, test in PATH.findall(text):
        target = ROOT / path
        if not target.exists():
            missing.append(path)
        elif test and f"def {test}(" not in target.read_text():
            missing.append(f"{path}::{test}")
    missing += [name for name in TEST_NAME.findall(text) if name not in defined_tests()]
    for target, anchor in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        linked = (document.parent / target).resolve() if target else document
        if not linked.exists():
            missing.append(f"link {target}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            missing.append(f"link {target}#{anchor}")
    assert not missing, f"{document.relative_to(ROOT)} names what does not exist: {missing}"
