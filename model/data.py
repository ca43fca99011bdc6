"""WordNet 3.0 corpus reading, positive-pair building and the held-out split.

The corpus is the Princeton WordNet database as Debian's ``wordnet-base`` package ships it
(``/usr/share/wordnet/data.{noun,verb,adj,adv}``). Each data line is

    offset lex_filenum ss_type w_cnt (word lex_id)* p_cnt (pointer)* [frames] | gloss

where the gloss is a definition followed by ``; "example sentence"`` parts.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_WORDNET_DIR = Path("/usr/share/wordnet")
DATA_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
_EXAMPLE = re.compile(r'"([^"]+)"')
_ADJ_MARKER = re.compile(r"\((?:a|p|ip)\)$")  # adjective position markers such as "galore(ip)"


@dataclass(frozen=True)
class Synset:
    key: str  # "<pos>:<offset>", unique across the four data files
    lemmas: tuple[str, ...]  # words of the synset, underscores turned to spaces
    definition: str  # gloss without its examples
    examples: tuple[str, ...]  # quoted example sentences


@dataclass(frozen=True)
class Pair:
    anchor: str
    positive: str
    synset: str  # the synset key, so batches and splits can reason about synsets


class WordNetNotFound(FileNotFoundError):
    pass


def find_wordnet(wordnet_dir: Path | str = DEFAULT_WORDNET_DIR) -> Path:
    path = Path(wordnet_dir)
    missing = [name for name in DATA_FILES if not (path / name).is_file()]
    if missing:
        raise WordNetNotFound(
            f"WordNet data files {missing} not found in {path}. Install Debian's 'wordnet-base' package "
            "(apt-get install wordnet-base) or pass --wordnet-dir pointing at a WordNet 3.0 'dict' folder."
        )
    return path


def parse_data_line(line: str) -> Synset | None:
    """Parse one line of a WordNet data file; license header lines (leading spaces) give None."""
    if not line or line[0] == " ":
        return None
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    offset, ss_type, w_cnt = fields[0], fields[2], int(fields[3], 16)
    words = fields[4 : 4 + 2 * w_cnt : 2]
    lemmas = tuple(_ADJ_MARKER.sub("", w).replace("_", " ") for w in words)
    gloss = gloss.strip()
    examples = tuple(e.strip() for e in _EXAMPLE.findall(gloss) if e.strip())
    first_quote = gloss.find('"')
    definition = (gloss[:first_quote] if first_quote >= 0 else gloss).strip().rstrip(";").strip()
    pos = "a" if ss_type == "s" else ss_type  # satellite adjectives live in data.adj
    return Synset(key=f"{pos}:{offset}", lemmas=lemmas, definition=definition, examples=examples)


def read_wordnet(wordnet_dir: Path | str = DEFAULT_WORDNET_DIR) -> list[Synset]:
    path = find_wordnet(wordnet_dir)
    synsets: list[Synset] = []
    for name in DATA_FILES:
        with open(path / name, encoding="utf-8", errors="replace") as f:
            for line in f:
                synset = parse_data_line(line)
                if synset is not None and synset.definition:
                    synsets.append(synset)
    return synsets


def is_held_out(synset_key: str, fraction: float = 0.02, seed: int = 0) -> bool:
    """Deterministic split by synset: a stable hash, independent of file order and Python's hash seed."""
    digest = hashlib.sha256(f"{seed}:{synset_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_synsets(
    synsets: Iterable[Synset], fraction: float = 0.02, seed: int = 0
) -> tuple[list[Synset], list[Synset]]:
    train: list[Synset] = []
    held_out: list[Synset] = []
    for s in synsets:
        (held_out if is_held_out(s.key, fraction, seed) else train).append(s)
    return train, held_out


def build_pairs(synsets: Iterable[Synset]) -> list[Pair]:
    """Positive pairs: each example sentence <-> its definition, and the lemma set <-> its definition."""
    pairs: list[Pair] = []
    for s in synsets:
        for example in s.examples:
            pairs.append(Pair(example, s.definition, s.key))
        pairs.append(Pair(", ".join(s.lemmas), s.definition, s.key))
    return pairs


def corpus_texts(synsets: Iterable[Synset]) -> Iterator[str]:
    """Every text the tokenizer should learn from: definitions, examples and lemmas."""
    for s in synsets:
        yield s.definition
        yield from s.examples
        yield ", ".join(s.lemmas)


def training_side(train: Sequence[Synset], held_out: Sequence[Synset]) -> tuple[list[Pair], list[str]]:
    """The training pairs and the tokenizer/TF-IDF corpus, with every held-out text taken out.

    Synsets are split by key, but WordNet repeats texts across synsets (a definition shared by two
    senses, a lemma like "pigment"): without this, ~500 held-out texts would be trained on.
    """
    held_texts = set(corpus_texts(held_out))
    pairs = [p for p in build_pairs(train) if p.anchor not in held_texts and p.positive not in held_texts]
    corpus = [t for t in corpus_texts(train) if t not in held_texts]
    return pairs, corpus


def synset_distinct_batches(
    pairs: list[Pair],
    batch_size: int,
    rng: random.Random,
    length: Callable[[Pair], int] | None = None,
    sort_window: int = 32,
) -> list[list[Pair]]:
    """Shuffle pairs into batches where no synset appears twice.

    In-batch negatives assume every other row is a wrong match; two pairs from one synset in a batch
    would share a definition and turn a correct match into a "negative". A pair whose synset is already
    in the batch being filled waits for the next batch.

    With ``length``, pairs are sorted by it within windows of ``sort_window`` batches and the batches
    shuffled afterwards: batches of similar lengths carry far less padding (and train faster)
    while every batch still draws from a random slice of the corpus.
    """
    order = pairs[:]
    rng.shuffle(order)
    if length is not None:
        window = batch_size * sort_window
        order = [p for start in range(0, len(order), window) for p in sorted(order[start : start + window], key=length)]
    batches: list[list[Pair]] = []
    current: list[Pair] = []
    seen: set[str] = set()
    waiting: list[Pair] = []
    for pair in order:
        if pair.synset in seen:
            waiting.append(pair)
            continue
        current.append(pair)
        seen.add(pair.synset)
        if len(current) == batch_size:
            batches.append(current)
            current, seen = [], set()
            still_waiting = []
            for w in waiting:
                if w.synset in seen or len(current) == batch_size - 1:
                    still_waiting.append(w)
                else:
                    current.append(w)
                    seen.add(w.synset)
            waiting = still_waiting
    if len(current) >= 2:
        batches.append(current)
    if length is not None:
        rng.shuffle(batches)
    return batches
