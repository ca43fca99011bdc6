"""A Transformer encoder written from scratch, after "Attention Is All You Need" (Vaswani et al., 2017).

Shapes in the comments: B batch, T sequence (padded), C d_model, nh heads, hs head size (C // nh),
F feed-forward inner size. The forward pass takes ``(input_ids, attention_mask)`` and returns one
mask-aware mean-pooled vector per row, written so that ``torch.jit.script`` and
``torch.onnx.export(dynamo=True)`` take it as is: typed arguments, no Python-only control flow on
tensor values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Added to the attention scores of padded keys: exp() of it underflows to exactly 0 in fp32 and fp16,
# so a padded key gets no weight while any real key is left. Small enough that a score plus it stays
# finite in fp16 (max 65504), so a row whose keys are all padding softmaxes to finite weights, not NaN.
MASK_VALUE = -1e4


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 8192  # tokenizer vocabulary, pad id included
    max_len: int = 128  # longest sequence the positional table covers, special tokens included
    d_model: int = 128  # width of the residual stream (C)
    n_heads: int = 4  # attention heads (nh); d_model must divide evenly
    n_layers: int = 2  # encoder layers
    d_ff: int = 512  # inner width of the position-wise feed-forward (F)
    dropout: float = 0.1  # on attention weights, sub-layer outputs and embeddings (training only)
    norm_first: bool = True  # pre-LN (True, stabler for brief training) or post-LN as in the paper
    layer_norm_eps: float = 1e-5
    pad_id: int = 0  # id of the padding token; its embedding row is kept at zero
    # Switches for the BERT family (model/pretrained.py); the defaults are the paper's encoder.
    positions: str = "sinusoidal"  # sinusoidal (fixed, paper) | learned (a trained table of max_len rows)
    type_vocab_size: int = 0  # >0: a token-type embedding table; every input is type 0, as in one-segment BERT
    embedding_norm: bool = False  # LayerNorm over the summed embeddings (BERT)
    activation: str = "relu"  # feed-forward non-linearity: relu (paper) | gelu (exact, erf-based, BERT)
    scale_embeddings: bool = True  # multiply token embeddings by sqrt(d_model) (paper); BERT does not
    # A fixed orthogonal (C, C) map after pooling, set after training (model/train.py, output_axes: components
    # ordered so that a prefix keeps the most); cosines between full-length embeddings do not change.
    output_rotation: bool = False

    def __post_init__(self) -> None:
        assert self.d_model % self.n_heads == 0, "d_model must be divisible by n_heads"
        assert self.vocab_size > 0 and self.max_len > 0 and self.n_layers > 0
        assert 0 <= self.pad_id < self.vocab_size
        assert 0.0 <= self.dropout < 1.0
        assert self.positions in ("sinusoidal", "learned"), (
            f"positions must be sinusoidal or learned, not {self.positions!r}"
        )
        assert self.activation in ("relu", "gelu"), f"activation must be relu or gelu, not {self.activation!r}"
        assert self.type_vocab_size >= 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class LearnedPositions(nn.Module):
    """A trained position table (BERT), added like the sinusoidal encoding."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, T, C)
        return x + self.table.weight[: x.size(1)].unsqueeze(0)  # (1, T, C) broadcast over B


class PositionalEncoding(nn.Module):
    """Fixed sinusoidal encoding (paper, section 3.5), stored as a buffer so it moves with the module."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)  # (max_len, 1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)  # (max_len, C)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])
        self.pe: Tensor
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, T, C)
        return x + self.pe[: x.size(1)].unsqueeze(0)  # (1, T, C) broadcast over B


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor,
    dropout_p: float = 0.0,
    training: bool = False,
    mask_value: float = MASK_VALUE,
) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V with padded keys excluded.

    q, k, v: (B, nh, T, hs); key_padding_mask: (B, T) bool, True where the key is padding.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, T)
    # Added, not masked_fill: exported, masked_fill is a Where that ONNX Runtime's CPU kernel broadcasts
    # slowly; a broadcast Add of the (B, 1, 1, T) bias costs far less (decisions/0002). Same weights:
    # exp(bias) is exactly 0 either way.
    bias = key_padding_mask[:, None, None, :].to(scores.dtype) * mask_value  # (B, 1, 1, T)
    scores = scores + bias
    weights = F.softmax(scores, dim=-1)  # (B, nh, T, T)
    weights = F.dropout(weights, p=dropout_p, training=training)
    return weights @ v  # (B, nh, T, hs)


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention with one fused Q/K/V projection (paper, section 3.2.2)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_size = config.d_model // config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_heads, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        y = scaled_dot_product_attention(q, k, v, key_padding_mask, self.dropout, self.training)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.out(y)


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear -> ReLU (or GELU) -> Linear (paper, section 3.3)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.d_model, config.d_ff)
        self.fc_out = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.gelu = config.activation == "gelu"

    def forward(self, x: Tensor) -> Tensor:
        # (B, T, C) -> (B, T, F) -> (B, T, C)
        h = self.fc_in(x)
        h = F.gelu(h) if self.gelu else F.relu(h)
        return self.fc_out(self.dropout(h))


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward sub-layers, each wrapped in residual + LayerNorm.

    Post-LN (paper): x = LN(x + Sublayer(x)). Pre-LN: x = x + Sublayer(LN(x)).
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.attention = MultiHeadAttention(config)
        self.feed_forward = FeedForward(config)
        self.norm1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        # x: (B, T, C) in and out
        if self.norm_first:
            x = x + self.dropout1(self.attention(self.norm1(x), key_padding_mask))
            x = x + self.dropout2(self.feed_forward(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout1(self.attention(x, key_padding_mask)))
            x = self.norm2(x + self.dropout2(self.feed_forward(x)))
        return x


def masked_mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the real (unpadded) token states of each row.

    hidden: (B, T, C); attention_mask: (B, T) with 1 for real tokens. Returns (B, C).
    """
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    summed = (hidden * mask).sum(dim=1)  # (B, C)
    counts = mask.sum(dim=1).clamp(min=1.0)  # (B, 1); clamp keeps an all-padding row finite
    return summed / counts


class Encoder(nn.Module):
    """Token embedding * sqrt(C) + positions (+ type 0) (-> LN) -> N encoder layers -> (final LN) -> mean pool
    (-> fixed rotation)."""

    if TYPE_CHECKING:  # for mypy only: TorchScript types the registered buffer itself
        rotation: Tensor | None

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.d_model = config.d_model
        self.max_len = config.max_len
        self.embedding_scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.positional_encoding: nn.Module = (
            LearnedPositions(config.d_model, config.max_len)
            if config.positions == "learned"
            else PositionalEncoding(config.d_model, config.max_len)
        )
        # One-segment inputs: every token has type 0, so only that row of the table is ever used.
        self.token_type_embedding = (
            nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        )
        self.embedding_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.embedding_norm else None
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.n_layers)])
        # Pre-LN leaves the residual stream un-normalised after the last layer; post-LN already ends in LN.
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None
        self.register_buffer("rotation", torch.eye(config.d_model) if config.output_rotation else None)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=module.embedding_dim**-0.5)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    def token_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Last layer's states for every position. input_ids, attention_mask: (B, T) -> (B, T, C)."""
        key_padding_mask = attention_mask == 0  # (B, T) True where padding
        x = self.token_embedding(input_ids) * self.embedding_scale  # (B, T, C)
        x = self.positional_encoding(x)
        if self.token_type_embedding is not None:
            x = x + self.token_type_embedding.weight[0]  # (C,) broadcast: type 0 everywhere
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        x = self.embedding_dropout(x)
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """input_ids, attention_mask: int64 (B, T) -> embeddings (B, C), not normalised."""
        pooled = masked_mean_pool(self.token_states(input_ids, attention_mask), attention_mask)  # (B, C)
        rotation = self.rotation  # a local: TorchScript narrows an Optional only there
        if rotation is not None:
            pooled = pooled @ rotation  # (B, C) @ (C, C): the same vectors in the ordered output axes
        return pooled
