"""A check outside WordNet: does the student order sentence pairs by similarity as the teacher does?

Sentences: first lines of docstrings in Python's standard library, English text that every machine with
Python has, read with ``ast`` (nothing is imported or executed). Pairs of them are scored by cosine
similarity with the student and with the teacher; the figure is Spearman's rank correlation between the
two lists. A student tuned only to WordNet's definitions would order unrelated text differently.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

MIN_CHARS, MAX_CHARS = 30, 200


def stdlib_sentences(count: int, seed: int = 0) -> list[str]:
    """`count` distinct docstring first lines from the standard library, in a seeded random order."""
    found: set[str] = set()
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        relative = path.relative_to(root).parts
        if any(part.startswith(("test", "site-packages", "idlelib")) for part in relative):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                line = doc.strip().split("\n", 1)[0].strip() if doc else ""
                if MIN_CHARS <= len(line) <= MAX_CHARS and " " in line and line[0].isalpha():
                    found.add(line)
    sentences = sorted(found)
    random.Random(seed).shuffle(sentences)
    return sentences[:count]


def similarity_agreement(
    student: Callable[[Sequence[str]], np.ndarray],
    teacher: Callable[[Sequence[str]], np.ndarray],
    sentences: Sequence[str],
    pairs: int,
    seed: int = 0,
) -> float:
    """Spearman correlation between student and teacher cosine similarities over random sentence pairs.
    student and teacher map texts to L2-normalised rows."""
    from scipy.stats import spearmanr

    rng = np.random.default_rng(seed)
    i = rng.integers(0, len(sentences), size=pairs)
    j = (i + rng.integers(1, len(sentences), size=pairs)) % len(sentences)  # never a sentence with itself
    s, t = student(sentences), teacher(sentences)
    return float(spearmanr((s[i] * s[j]).sum(1), (t[i] * t[j]).sum(1)).statistic)
