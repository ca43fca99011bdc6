"""Realistic request texts from the held-out WordNet synsets (never trained on).

The mix: lemma sets (a few tokens), example sentences and definitions (10-30 tokens), and long texts
(several definitions joined) near the model's 128-token limit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from model.data import DEFAULT_WORDNET_DIR, read_wordnet, split_synsets

LONG_TEXT_CHARS = 520  # about 110-130 WordPiece tokens of WordNet prose


@dataclass(frozen=True)
class TextPool:
    short: list[str]
    medium: list[str]
    long: list[str]

    def mixed(self, rng: random.Random, n: int) -> list[str]:
        """n texts of realistic lengths: mostly short and medium, some long."""
        pools = (self.short, self.medium, self.medium, self.medium, self.long)
        return [rng.choice(rng.choice(pools)) for _ in range(n)]


def load_pool(wordnet_dir: str = str(DEFAULT_WORDNET_DIR), seed: int = 0) -> TextPool:
    _, held_out = split_synsets(read_wordnet(wordnet_dir))
    rng = random.Random(seed)
    short = [", ".join(s.lemmas) for s in held_out]
    medium = [s.definition for s in held_out] + [e for s in held_out for e in s.examples]
    long = []
    definitions = [s.definition for s in held_out]
    for _ in range(200):
        parts: list[str] = []
        while sum(len(p) + 2 for p in parts) < LONG_TEXT_CHARS:
            parts.append(rng.choice(definitions))
        long.append("; ".join(parts)[:LONG_TEXT_CHARS])
    return TextPool(short, medium, long)
