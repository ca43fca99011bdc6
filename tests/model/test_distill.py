from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tqdm import tqdm

import model.distill
from contract.manifest import TEACHER_FILE, Manifest
from model.checkpoint import encode_texts
from model.distill import (
    cache_key,
    flops_per_token,
    teacher_embeddings,
    teacher_token_init,
    token_strings,
)
from model.train import DISTILLED, PLAIN, TrainConfig, resolve_teacher, train
from tests.conftest import tiny_train_config


def test_teacher_token_init_keeps_the_teachers_geometry() -> None:
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(50, 4)) @ rng.normal(size=(4, 16))  # rank 4 in 16 dimensions
    init = teacher_token_init(teacher, 8)
    assert init.shape == (50, 8) and np.linalg.norm(init, axis=1).mean() == pytest.approx(1.0, rel=1e-5)
    centred = teacher - teacher.mean(axis=0)
    # PCA to a width above the rank keeps every pairwise distance, up to the one scale of the init.
    distances = np.linalg.norm(centred[:, None] - centred[None], axis=-1)
    init_distances = np.linalg.norm(init[:, None] - init[None], axis=-1)
    np.testing.assert_allclose(init_distances * (distances.max() / init_distances.max()), distances, atol=1e-4)
    wider = teacher_token_init(teacher[:, :3], 8)  # wider than the teacher: the extra columns stay zero
    assert np.all(wider[:, 3:] == 0) and np.any(wider[:, :3] != 0)


def test_token_strings_drop_the_continuation_marker() -> None:
    assert token_strings(["[CLS]", "dog", "##ing", "##"]) == ["[CLS]", "dog", "ing", "##"]


def test_flops_per_token_of_minilm() -> None:
    # all-MiniLM-L6-v2: 6 layers, d 384, d_ff 1536 -> 2 x 6 x (4 x 384^2 + 2 x 384 x 1536)
    assert flops_per_token(6, 384, 1536) == 2 * 6 * (589_824 + 1_179_648) == 21_233_664


def test_the_teacher_gives_the_same_rows_in_order_on_any_number_of_threads(
    tiny_bert_artifacts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several batches of mixed lengths (sorted into batches by length, so each batch's rows come from all over
    # the list): side by side on three threads, every row lands where its text is, as one call at a time.
    texts = [" ".join(["word"] * (1 + i % 9)) + f" {i}" for i in range(3 * model.distill.TEACHER_BATCH + 5)]
    monkeypatch.setattr(model.distill, "cores", lambda: 1)
    alone = model.distill.run_teacher(tiny_bert_artifacts, texts, precision="fp32")
    monkeypatch.setattr(model.distill, "cores", lambda: 3)
    side_by_side = model.distill.run_teacher(tiny_bert_artifacts, texts, precision="fp32")
    assert alone.shape == (len(texts), Manifest.read(tiny_bert_artifacts).dim)
    np.testing.assert_allclose(side_by_side, alone, rtol=0, atol=1e-6)
    assert not np.allclose(alone[0], alone[1])  # rows differ, so a row in the wrong place would show
    for i in (0, 7, len(texts) - 1):  # and each is its own text's embedding, as computed alone
        one = model.distill.run_teacher(tiny_bert_artifacts, [texts[i]], precision="fp32")
        np.testing.assert_allclose(side_by_side[i], one[0], rtol=0, atol=1e-5)


def test_the_teachers_progress_bar_counts_padded_tokens(
    tiny_bert_artifacts: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The batches run shortest first, so their time grows along the bar: counted in batches, its estimate of
    # the time left would be a third of the real one on the training corpus.
    monkeypatch.setattr(model.distill, "TEACHER_BATCH", 4)
    texts = [" ".join(["word"] * (1 + i % 9)) for i in range(84)]  # 21 batches, enough to show a bar
    model.distill.run_teacher(tiny_bert_artifacts, texts, precision="fp32")
    tokenizer = Tokenizer.from_file(str(tiny_bert_artifacts / "tokenizer.json"))
    lengths = sorted(len(row) for row in encode_texts(tokenizer, texts, model.distill.TEACHER_MAX_TOKENS))
    padded = sum(4 * max(lengths[start : start + 4]) for start in range(0, len(lengths), 4))
    assert padded != len(lengths) // 4  # the batches are not all one token long
    total = tqdm.format_sizeof(padded)
    final = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    assert f"| {total}/{total} [" in final and "token/s" in final


def tiny_config(out_dir: Path, teacher_dir: str = "") -> TrainConfig:
    return tiny_train_config(out_dir=str(out_dir), teacher_dir=teacher_dir, outside_sentences=200, outside_pairs=500)


def test_distillation_caches_the_teacher_and_changes_the_objective(
    tiny_bert_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config(tmp_path, str(tiny_bert_artifacts))
    first = train(config)
    assert first.summary["teacher"] == "test/tiny-bert" and first.summary["teacher_cache"] == "computed"
    assert list((tmp_path / "teacher-cache").glob("teacher-*.npy"))

    def no_teacher_runs(*args: object, **kwargs: object) -> None:
        raise AssertionError("a repeat run ran the teacher")

    monkeypatch.setattr(model.distill, "run_teacher", no_teacher_runs)
    second = train(config)  # training targets, token init and the evaluation's teacher rows all from the cache
    monkeypatch.undo()
    assert second.summary["teacher_cache"] == "hit"
    assert second.losses == first.losses  # the cache gives the teacher exactly as first used
    assert (
        second.evaluation == first.evaluation and second.summary["outside_wordnet"] == first.summary["outside_wordnet"]
    )
    assert set(first.evaluation) == {"untrained", "tfidf", "trained", "teacher", "trained @16", "teacher @16"}
    gap = first.summary["prefix_comparisons"]["trained @16 recall@1 - teacher"]
    at_16, teacher = first.evaluation["trained @16"]["recall_at_1"], first.evaluation["teacher"]["recall_at_1"]
    assert gap["value"] == pytest.approx(at_16 - teacher) and gap["low"] <= gap["value"] <= gap["high"]
    outside = first.summary["outside_wordnet"]
    assert outside["reference"] == "test/tiny-bert" and outside["pairs"] == 500 and -1 <= outside["spearman"] <= 1
    plain = train(tiny_config(tmp_path))
    assert "teacher" not in plain.summary and plain.losses != first.losses
    matched = train(replace(config, distill_weight=1.0))
    projected = train(replace(config, distill_loss="projection", distill_weight=1.0))
    assert projected.losses != matched.losses and projected.summary["distill_loss"] == "projection"
    prefixed = train(replace(config, distill_weight=1.0, matryoshka_weight=0.5, matryoshka_distill=True))
    full_only = train(replace(config, distill_weight=1.0, matryoshka_weight=0.5))  # the default: full length only
    assert full_only.losses != prefixed.losses  # the teacher's similarity also shapes each prefix when on
    assert prefixed.summary["matryoshka_distill"] and not full_only.summary["matryoshka_distill"]
    # The head that maps the student to the teacher's width is for training only: the model is the plain encoder.
    assert projected.model.state_dict().keys() == plain.model.state_dict().keys()


def test_a_distilling_run_says_each_step_before_it_runs(
    tiny_bert_artifacts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # On the real corpus each of these takes seconds to minutes before any bar shows (make run's progress).
    train(replace(tiny_config(tmp_path, str(tiny_bert_artifacts)), progress=True))
    said = [line.split("]: ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("train [")]
    steps = [
        "training pairs; WordPiece vocabulary",
        "token ids",
        "the teacher's embeddings of",
        "output axes (shared) from",
        "held-out WordNet retrieval",
        "the same for test/tiny-bert",
    ]
    assert len(said) == len(steps) and all(step in line for step, line in zip(steps, said, strict=True)), said


def test_the_student_starts_from_the_teachers_token_embeddings(tiny_bert_artifacts: Path, tmp_path: Path) -> None:
    config = replace(tiny_config(tmp_path, str(tiny_bert_artifacts)), steps=0)
    start = train(config)
    vocab = [token for token, _ in sorted(start.tokenizer.get_vocab().items(), key=lambda item: item[1])]
    token_vectors, summary = teacher_embeddings(tiny_bert_artifacts, token_strings(vocab), tmp_path / "teacher-cache")
    assert summary["teacher_cache"] == "hit"  # the run cached the teacher's view of every token
    expected = teacher_token_init(token_vectors, config.model.d_model)
    expected[config.model.pad_id] = 0
    np.testing.assert_allclose(start.model.token_embedding.weight.detach().numpy(), expected, atol=1e-6)
    random_start = train(replace(config, teacher_init=False))
    assert not np.allclose(random_start.model.token_embedding.weight.detach().numpy(), expected, atol=1e-2)


def test_the_recipe_follows_the_starting_point() -> None:
    assert (TrainConfig().train_steps, TrainConfig().vocabulary) == (PLAIN.steps, PLAIN.vocab_size)
    distilled = TrainConfig(teacher_dir="t")
    assert (distilled.train_steps, distilled.vocabulary) == (DISTILLED.steps, DISTILLED.vocab_size)
    assert DISTILLED.vocab_size > PLAIN.vocab_size and distilled.prefix_weight == DISTILLED.matryoshka_weight > 0
    assert TrainConfig().prefix_weight == PLAIN.matryoshka_weight == 0.0
    assert TrainConfig(teacher_dir="t", matryoshka_weight=0.0).prefix_weight == 0.0
    assert TrainConfig(teacher_dir="t", teacher_init=False).recipe == PLAIN
    explicit = TrainConfig(teacher_dir="t", vocab_size=500, steps=0)
    assert (explicit.train_steps, explicit.vocabulary) == (0, 500)


def test_an_unknown_distillation_loss_is_refused() -> None:
    with pytest.raises(ValueError, match="distill_loss must be one of"):
        TrainConfig(distill_loss="kl")


def test_teacher_choice(tmp_path: Path) -> None:
    assert resolve_teacher("none", tmp_path) == ""
    with pytest.raises(SystemExit, match="no exported model in"):
        resolve_teacher(str(tmp_path / "nowhere"), tmp_path)
    # all-MiniLM-L6-v2 not exported yet: training says which step to run, and exports nothing itself
    with pytest.raises(SystemExit, match="make export-pretrained"):
        resolve_teacher("auto", tmp_path)
    assert not (tmp_path / "minilm").exists()


def test_the_teacher_runs_the_exports_teacher_build_not_the_int8_build_kept_for_serving(
    tiny_bert_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its targets do not follow which int8 build the export's timing kept (docs/decisions/0028)."""
    import onnxruntime as ort

    opened: list[tuple[str, tuple[str, ...]]] = []
    real = ort.InferenceSession

    def recording(path: str, options: object, providers: list[str], disabled_optimizers: Sequence[str] = ()) -> object:
        opened.append((Path(path).name, tuple(disabled_optimizers)))
        return real(path, options, providers=providers, disabled_optimizers=disabled_optimizers)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    teacher_embeddings(tiny_bert_artifacts, ["a text", "another text"], tmp_path / "cache")
    assert opened == [(TEACHER_FILE, ())]  # every ONNX Runtime fusion, as the recipe's targets were made


def test_the_teacher_cache_is_keyed_by_the_file_the_teacher_runs(tiny_bert_artifacts: Path, tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_bert_artifacts, teacher)
    manifest = Manifest.read(teacher)
    before = cache_key(teacher, ["a text"], 32, "int8", "float16")
    replace(manifest, files={**manifest.files, "model.int8.onnx": "0" * 64}).write(teacher)  # another build served
    assert cache_key(teacher, ["a text"], 32, "int8", "float16") == before
    replace(manifest, files={**manifest.files, TEACHER_FILE: "0" * 64}).write(teacher)  # another teacher build
    assert cache_key(teacher, ["a text"], 32, "int8", "float16") != before
    assert cache_key(teacher, ["a text"], 32, "fp32", "float16") == cache_key(
        tiny_bert_artifacts, ["a text"], 32, "fp32", "float16"
    )


def test_a_cache_write_cut_short_leaves_no_file_a_repeat_run_would_trust(
    tiny_bert_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "teacher-cache"
    texts = ["a small domesticated carnivore", "a river"]
    real_save = np.save

    def interrupted_save(file: object, array: np.ndarray) -> None:  # Ctrl-C half-way through the write
        real_save(file, array)
        if isinstance(file, (str, Path)):
            Path(file).write_bytes(Path(file).read_bytes()[:64])
        else:
            file.truncate(64)  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        teacher_embeddings(tiny_bert_artifacts, texts, cache)
    monkeypatch.undo()
    assert not list(cache.glob("teacher-*.npy"))  # nothing under the name a repeat run loads
    embeddings, summary = teacher_embeddings(tiny_bert_artifacts, texts, cache)
    assert summary["teacher_cache"] == "computed" and embeddings.shape[0] == len(texts)
    again, summary = teacher_embeddings(tiny_bert_artifacts, texts, cache)
    assert summary["teacher_cache"] == "hit"
    np.testing.assert_array_equal(again, embeddings)
