from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from model.pretrained import UnsupportedCheckpoint, from_pretrained
from tests.tiny_bert import MAX_SEQ_LENGTH, SENTENCES


def reference_embeddings(folder: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face BertModel + sentence-transformers mean pooling: what the checkpoint means."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, C)
    weights = mask.unsqueeze(-1).float()
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def test_matches_transformers_bert_with_mean_pooling(tiny_bert: Path) -> None:
    pretrained = from_pretrained(tiny_bert)
    encodings = pretrained.tokenizer.encode_batch(SENTENCES)  # mixed lengths, one padded batch
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    assert mask.sum(1).min() < mask.shape[1], "the batch must contain padding"
    with torch.no_grad():
        ours = pretrained.model(ids, mask)
    theirs = reference_embeddings(tiny_bert, ids, mask)
    assert float((ours - theirs).abs().max()) <= 1e-5
    assert float(theirs.abs().mean()) > 0.05  # not a trivially small output


def test_takes_the_max_length_and_pad_id_from_the_checkpoint(tiny_bert: Path) -> None:
    pretrained = from_pretrained(tiny_bert)
    config = pretrained.model.config
    assert config.max_len == MAX_SEQ_LENGTH and config.pad_id == 0
    assert pretrained.tokenizer.truncation["max_length"] == MAX_SEQ_LENGTH
    long = pretrained.tokenizer.encode(" ".join(["dog"] * 100))
    assert len(long.ids) == MAX_SEQ_LENGTH


def copy_with(tiny_bert: Path, tmp_path: Path, file: str, change: dict[str, object]) -> Path:
    folder = tmp_path / "changed"
    shutil.copytree(tiny_bert, folder)
    path = folder / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return folder


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        ("config.json", {"model_type": "roberta"}, "model_type 'roberta' (only bert is supported)"),
        ("config.json", {"position_embedding_type": "relative_key"}, "only absolute"),
        ("config.json", {"hidden_act": "relu"}, "hidden_act 'relu'"),
        (
            "1_Pooling/config.json",
            {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True},
            "only mean pooling",
        ),
    ],
    ids=["architecture", "positions", "activation", "cls-pooling"],
)
def test_refuses_what_it_cannot_map_exactly(
    tiny_bert: Path, tmp_path: Path, file: str, change: dict[str, object], message: str
) -> None:
    with pytest.raises(UnsupportedCheckpoint, match=re.escape(message)):
        from_pretrained(copy_with(tiny_bert, tmp_path, file, change))


def test_refuses_a_folder_without_safetensors(tiny_bert: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_bert, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(UnsupportedCheckpoint, match=re.escape("model.safetensors not found")):
        from_pretrained(folder)


def test_default_config_is_still_the_papers_encoder() -> None:
    from model.transformer import Encoder, EncoderConfig

    model = Encoder(EncoderConfig())
    names = set(model.state_dict())
    assert not any(n.startswith(("token_type_embedding", "embedding_norm", "positional_encoding.table")) for n in names)
    assert model.embedding_scale == pytest.approx(np.sqrt(128))  # token embeddings x sqrt(d_model), as in the paper
