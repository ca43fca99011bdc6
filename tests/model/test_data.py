from __future__ import annotations

import random
from pathlib import Path

import pytest

from model.data import (
    Pair,
    WordNetNotFound,
    build_pairs,
    corpus_texts,
    find_wordnet,
    is_held_out,
    parse_data_line,
    read_wordnet,
    split_synsets,
    synset_distinct_batches,
    training_side,
)

BREATHE = (
    "00001740 29 v 04 breathe 0 take_a_breath 0 respire 0 suspire 3 021 * 00005041 v 0000 "
    "* 00004227 v 0000 02 + 02 00 + 08 00 | draw air into, and expel out of, the lungs; "
    '"I can breathe better when the air is clean"; "The patient is respiring"  \n'
)
SATELLITE = "00002312 00 s 02 abaxial 0 dorsal(a) 0 002 ;c 06037666 n 0000 | facing away from the axis  \n"


def test_parse_data_line_splits_definition_examples_and_lemmas() -> None:
    synset = parse_data_line(BREATHE)
    assert synset is not None
    assert synset.key == "v:00001740"
    assert synset.lemmas == ("breathe", "take a breath", "respire", "suspire")
    assert synset.definition == "draw air into, and expel out of, the lungs"
    assert synset.examples == ("I can breathe better when the air is clean", "The patient is respiring")


def test_parse_satellite_adjective_and_header() -> None:
    synset = parse_data_line(SATELLITE)
    assert synset is not None
    assert synset.key == "a:00002312"
    assert synset.lemmas == ("abaxial", "dorsal")
    assert synset.examples == ()
    assert parse_data_line("  1 This software and database is being provided\n") is None


def test_missing_wordnet_names_the_package_and_flag(tmp_path: Path) -> None:
    with pytest.raises(WordNetNotFound, match=r"wordnet-base.*--wordnet-dir"):
        find_wordnet(tmp_path)


def test_reader_on_a_small_dict_folder(tmp_path: Path) -> None:
    for name in ("data.noun", "data.verb", "data.adj", "data.adv"):
        (tmp_path / name).write_text("  1 license header\n")
    (tmp_path / "data.verb").write_text("  1 header\n" + BREATHE)
    (tmp_path / "data.adj").write_text(SATELLITE)
    synsets = read_wordnet(tmp_path)
    assert [s.key for s in synsets] == ["v:00001740", "a:00002312"]
    pairs = build_pairs(synsets)
    assert Pair("I can breathe better when the air is clean", synsets[0].definition, "v:00001740") in pairs
    assert Pair("breathe, take a breath, respire, suspire", synsets[0].definition, "v:00001740") in pairs
    assert len(pairs) == 2 + 1 + 1  # two examples + two lemma sets


def test_held_out_split_is_deterministic_disjoint_and_about_two_percent() -> None:
    keys = [f"n:{i:08d}" for i in range(20000)]
    held = [k for k in keys if is_held_out(k)]
    assert held == [k for k in keys if is_held_out(k)]
    assert 0.015 < len(held) / len(keys) < 0.025
    assert set(held) != {k for k in keys if is_held_out(k, seed=1)}


def test_no_held_out_text_appears_on_the_training_side() -> None:
    synsets = read_wordnet()  # the real corpus `make setup` installs
    train, held = split_synsets(synsets)
    pairs, corpus = training_side(train, held)  # what model/train.py trains the tokenizer and model on
    held_texts = set(corpus_texts(held))
    assert len(synsets) > 100_000 and len(held_texts) > 4000 and len(pairs) > 100_000
    assert not {t for p in pairs for t in (p.anchor, p.positive)} & held_texts
    assert not set(corpus) & held_texts


def test_batches_never_hold_one_synset_twice() -> None:
    pairs = [Pair(f"a{i}", f"d{i % 40}", f"s{i % 40}") for i in range(400)]  # 10 pairs per synset
    batches = synset_distinct_batches(pairs, batch_size=16, rng=random.Random(0))
    assert all(len({p.synset for p in b}) == len(b) for b in batches)
    assert all(len(b) <= 16 for b in batches)
    assert sum(len(b) for b in batches) >= 0.9 * len(pairs)


def test_length_sorted_batches_hold_similar_lengths_and_stay_synset_distinct() -> None:
    rng = random.Random(0)
    pairs = [Pair("x" * rng.randint(1, 60), "d", f"s{i % 500}") for i in range(4000)]
    plain = synset_distinct_batches(pairs, 32, random.Random(1))
    sorted_ = synset_distinct_batches(pairs, 32, random.Random(1), length=lambda p: len(p.anchor))

    def padding(batches: list[list[Pair]]) -> int:
        return sum(len(b) * max(len(p.anchor) for p in b) - sum(len(p.anchor) for p in b) for b in batches)

    assert padding(sorted_) < padding(plain) / 3
    assert all(len({p.synset for p in b}) == len(b) for b in sorted_)
    assert sum(map(len, sorted_)) >= 0.9 * len(pairs)
