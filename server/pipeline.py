"""The serving pipeline without transport: validate -> tokenize -> batch -> normalise.

server/service.py wraps it in gRPC; tests and the benchmark can drive it directly.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.batcher import Batcher
from server.errors import InvalidInput, Overloaded
from server.metrics import Metrics
from server.tokenize import TextTokenizer

MIN_TOKENS_PER_INPUT = 2  # [CLS] and [SEP]


@dataclass(frozen=True)
class Limits:
    max_client_batch_size: int
    max_input_chars: int


@dataclass(frozen=True)
class Embedded:
    embeddings: np.ndarray  # (n, dim) float32 in input order
    token_counts: list[int]
    truncated: list[int]
    tokenize_seconds: float
    queue_seconds: float
    inference_seconds: float


def l2_normalize(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def validate(texts: list[str], limits: Limits) -> None:
    """Cheap checks before any tokenization; messages name the offending input."""
    if not texts:
        raise InvalidInput("inputs is empty: send at least one text")
    if len(texts) > limits.max_client_batch_size:
        raise InvalidInput(
            f"{len(texts)} inputs, more than max_client_batch_size={limits.max_client_batch_size}; split the request"
        )
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidInput(f"inputs[{i}] is empty or only whitespace")
        if len(text) > limits.max_input_chars:
            raise InvalidInput(
                f"inputs[{i}] has {len(text)} characters, more than max_input_chars={limits.max_input_chars}"
            )


class Pipeline:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        batcher: Batcher,
        limits: Limits,
        metrics: Metrics,
        tokenizer_threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.limits = limits
        self.metrics = metrics
        self._tokenize_pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="tokenize")

    async def embed(self, texts: list[str], truncate: bool, normalize: bool, deadline: float | None) -> Embedded:
        validate(texts, self.limits)
        policy = self.batcher.policy
        if self.batcher.queued_tokens + MIN_TOKENS_PER_INPUT * len(texts) > policy.max_queue_tokens:
            # Refuse before paying for tokenization: the queue cannot take even the shortest version.
            raise Overloaded(f"queue full ({self.batcher.queued_tokens} tokens waiting); retry later")
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, texts, truncate)
        tokenize_seconds = time.perf_counter() - started
        self.metrics.tokenize_duration.observe(tokenize_seconds)
        result = await self.batcher.submit(encoded.rows, deadline)
        embeddings = l2_normalize(result.embeddings) if normalize else result.embeddings
        counts = encoded.token_counts
        self.metrics.inputs.inc(len(texts))
        self.metrics.tokens.inc(sum(counts))
        return Embedded(
            embeddings=embeddings,
            token_counts=counts,
            truncated=encoded.truncated,
            tokenize_seconds=tokenize_seconds,
            queue_seconds=result.queue_seconds,
            inference_seconds=result.inference_seconds,
        )

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
