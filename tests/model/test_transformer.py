from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.transformer import (
    Encoder,
    EncoderConfig,
    MultiHeadAttention,
    PositionalEncoding,
    scaled_dot_product_attention,
)

SMALL = EncoderConfig(vocab_size=100, max_len=24, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0)


def padded_batch(lengths: list[int], seq: int, vocab: int = 100, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def test_attention_matches_torch_sdpa_with_padding_mask() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 9, 8) for _ in range(3))
    key_padding = torch.zeros(3, 9, dtype=torch.bool)
    key_padding[1, 5:] = True
    key_padding[2, 1:] = True  # only one real key
    ours = scaled_dot_product_attention(q, k, v, key_padding)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=~key_padding[:, None, None, :])
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def test_multi_head_attention_matches_nn_multihead_attention() -> None:
    torch.manual_seed(0)
    ours = MultiHeadAttention(SMALL).eval()
    reference = torch.nn.MultiheadAttention(SMALL.d_model, SMALL.n_heads, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(ours.qkv.weight)  # same [q; k; v] row order as our fused projection
        reference.in_proj_bias.copy_(ours.qkv.bias)
        reference.out_proj.weight.copy_(ours.out.weight)
        reference.out_proj.bias.copy_(ours.out.bias)
    x = torch.randn(2, 7, SMALL.d_model)
    key_padding = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    expected, _ = reference(x, x, x, key_padding_mask=key_padding, need_weights=False)
    torch.testing.assert_close(ours(x, key_padding), expected, atol=1e-5, rtol=1e-5)


def test_positional_encoding_follows_the_paper() -> None:
    pe = PositionalEncoding(d_model=16, max_len=50).pe
    pos, i = 7, 3
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert "pe" not in PositionalEncoding(16, 50).state_dict()  # a buffer derived from the config


@pytest.mark.parametrize("norm_first", [True, False])
def test_padded_positions_never_change_real_positions(norm_first: bool) -> None:
    torch.manual_seed(0)
    model = Encoder(EncoderConfig(**{**SMALL.to_dict(), "norm_first": norm_first})).eval()
    ids, mask = padded_batch([5, 9], seq=9)
    garbage = ids.clone()
    garbage[0, 5:] = torch.tensor([3, 44, 97, 12])  # different tokens under the padding
    with torch.no_grad():
        clean = model.token_states(ids, mask)
        noisy = model.token_states(garbage, mask)
    torch.testing.assert_close(clean[0, :5], noisy[0, :5], atol=0, rtol=0)
    torch.testing.assert_close(model(ids, mask), model(garbage, mask), atol=0, rtol=0)


@pytest.mark.parametrize("norm_first", [True, False])
def test_row_result_does_not_depend_on_batch_padding(norm_first: bool) -> None:
    torch.manual_seed(0)
    model = Encoder(EncoderConfig(**{**SMALL.to_dict(), "norm_first": norm_first})).eval()
    ids, mask = padded_batch([3, 20, 11, 1], seq=20)
    with torch.no_grad():
        batched = model(ids, mask)
        for row, length in enumerate([3, 20, 11, 1]):
            alone = model(ids[row : row + 1, :length], mask[row : row + 1, :length])
            torch.testing.assert_close(alone[0], batched[row], atol=1e-5, rtol=1e-5)


def test_single_token_and_all_padding_rows_stay_finite() -> None:
    model = Encoder(SMALL).eval()
    ids, mask = padded_batch([1, 24, 0], seq=24)
    with torch.no_grad():
        out = model(ids, mask)
    assert out.shape == (3, SMALL.d_model)
    assert torch.isfinite(out).all()


def test_pre_ln_has_final_norm_and_post_ln_does_not() -> None:
    assert Encoder(SMALL).final_norm is not None
    assert Encoder(EncoderConfig(**{**SMALL.to_dict(), "norm_first": False})).final_norm is None


def test_config_rejects_heads_that_do_not_divide_width() -> None:
    with pytest.raises(AssertionError):
        EncoderConfig(d_model=30, n_heads=4)


def test_dropout_is_active_in_training_only() -> None:
    model = Encoder(EncoderConfig(**{**SMALL.to_dict(), "dropout": 0.5}))
    ids, mask = padded_batch([6, 6], seq=6)
    model.train()
    assert not torch.equal(model(ids, mask), model(ids, mask))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, mask), model(ids, mask))


def test_scripted_model_matches_eager() -> None:
    from export.torchscript import script

    model = Encoder(SMALL).eval()
    ids, mask = padded_batch([4, 13, 1], seq=13)
    with torch.no_grad():
        torch.testing.assert_close(script(model)(ids, mask), model(ids, mask), atol=1e-6, rtol=1e-6)
