"""The serving pipeline without transport: validate -> tokenize -> batch -> normalise.

Texts enter through ``embed``; token id rows already made by a client (the Open Inference
Protocol's token mode) enter through ``embed_rows`` and join the same batches.

server/service.py wraps it in gRPC; tests and the benchmark can drive it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.batcher import Batcher, RunBatch
from server.errors import InvalidInput, Overloaded
from server.metrics import ModelMetrics
from server.tokenize import Encoded, TextTokenizer

MIN_TOKENS_PER_INPUT = 2  # [CLS] and [SEP]
INLINE_TOKENIZE_CHARS = 1024  # requests this short are tokenized on the event loop (~20 us a short text)


@dataclass(frozen=True)
class Limits:
    max_client_batch_size: int
    max_input_chars: int
    max_tokenizing_chars: int  # characters waiting for or in tokenization, all requests together


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


def with_unit_rows(run_batch: RunBatch) -> RunBatch:
    """The backend's rows followed by the same rows normalised: (B, dim) -> (B, 2 x dim).

    Normalising a whole batch at once in the inference thread costs about what normalising one
    request costs on the event loop (numpy's per-call overhead dominates rows this small), and a
    request then only picks its half.
    """

    def run_with_unit_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
        embeddings = run_batch(rows)
        return np.concatenate([embeddings, l2_normalize(embeddings)], axis=1)

    return run_with_unit_rows


def check_count(n: int, limits: Limits) -> None:
    if n > limits.max_client_batch_size:
        raise InvalidInput(
            f"{n} inputs, more than max_client_batch_size={limits.max_client_batch_size}; split the request"
        )


def validate(texts: Sequence[str], limits: Limits, prepare: Callable[[str], str] = str) -> list[str]:
    """Cheap checks before any tokenization, in one pass; messages name the offending input.

    Returns each text passed through ``prepare`` (the tokenizer's cut when truncating), so a long
    input is read from the request once and only its prefix is kept.
    """
    if not texts:
        raise InvalidInput("inputs is empty: send at least one text")
    check_count(len(texts), limits)
    prepared = []
    for i, text in enumerate(texts):
        if not text or text.isspace():
            raise InvalidInput(f"inputs[{i}] is empty or only whitespace")
        if len(text) > limits.max_input_chars:
            raise InvalidInput(
                f"inputs[{i}] has {len(text)} characters, more than max_input_chars={limits.max_input_chars}"
            )
        prepared.append(prepare(text))
    return prepared


class Pipeline:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        batcher: Batcher,
        limits: Limits,
        metrics: ModelMetrics,
        tokenizer_threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.batcher = batcher
        batcher.run_batch = with_unit_rows(batcher.run_batch)  # its batches now carry both halves
        self.limits = limits
        self.metrics = metrics
        self._tokenize_pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="tokenize")
        self._tokenizing_chars = 0  # the tokenization stage's load: it refuses work beyond its limit

    async def embed(self, texts: Sequence[str], truncate: bool, normalize: bool, deadline: float | None) -> Embedded:
        """``texts`` may be the request message's own sequence: it is read, never kept whole."""
        prepared = validate(texts, self.limits, self.tokenizer.cut if truncate else str)
        self._admit(MIN_TOKENS_PER_INPUT * len(texts), len(texts))
        started = time.perf_counter()
        chars = sum(len(t) for t in prepared)
        if chars <= INLINE_TOKENIZE_CHARS:
            # Cheaper than a thread hop, and a short request never waits behind long ones' tokenization.
            encoded = self.tokenizer.encode(prepared, truncate, texts)
        else:
            encoded = await self._tokenize_in_pool(prepared, truncate, texts, chars)
        tokenize_seconds = time.perf_counter() - started
        self.metrics.tokenize_duration.observe(tokenize_seconds)
        return await self._compute(encoded.rows, encoded.truncated, normalize, deadline, tokenize_seconds)

    async def embed_rows(self, rows: list[np.ndarray], normalize: bool, deadline: float | None) -> Embedded:
        """At least one token id row (special tokens included, no padding), checked by the caller.

        Nothing to tokenize, so the batcher's own admission (on the rows' real tokens) is the only one.
        """
        check_count(len(rows), self.limits)
        return await self._compute(rows, [], normalize, deadline, 0.0)

    def _admit(self, min_tokens: int, n: int) -> None:  # before tokenization: the shortest possible request
        """Refuse before paying for tokenization when the queue cannot take even the shortest version."""
        policy = self.batcher.policy
        if min_tokens > policy.max_queue_tokens:
            raise InvalidInput(
                f"{n} inputs need at least {min_tokens} tokens, more than the server queues at once "
                f"({policy.max_queue_tokens}); split the request"
            )
        if self.batcher.queued_tokens + min_tokens > policy.max_queue_tokens:
            raise Overloaded(f"queue full ({self.batcher.queued_tokens} tokens waiting); retry later")

    async def _compute(
        self,
        rows: list[np.ndarray],
        truncated: list[int],
        normalize: bool,
        deadline: float | None,
        tokenize_seconds: float,
    ) -> Embedded:
        result = await self.batcher.submit(rows, deadline)
        dim = result.embeddings.shape[1] // 2
        embeddings = result.embeddings[:, dim:] if normalize else result.embeddings[:, :dim]
        counts = [len(r) for r in rows]
        self.metrics.inputs.inc(len(rows))
        self.metrics.tokens.inc(sum(counts))
        return Embedded(
            embeddings=embeddings,
            token_counts=counts,
            truncated=truncated,
            tokenize_seconds=tokenize_seconds,
            queue_seconds=result.queue_seconds,
            inference_seconds=result.inference_seconds,
        )

    async def _tokenize_in_pool(self, prepared: list[str], truncate: bool, texts: Sequence[str], chars: int) -> Encoded:
        """The bounded tokenization stage: at most max_tokenizing_chars in progress, the rest refused."""
        if self._tokenizing_chars + chars > self.limits.max_tokenizing_chars:
            raise Overloaded(f"tokenization is full ({self._tokenizing_chars} characters in progress); retry later")
        loop = asyncio.get_running_loop()
        self._tokenizing_chars += chars
        work = self._tokenize_pool.submit(self.tokenizer.encode, prepared, truncate, texts)

        def release(_: object) -> None:  # when the thread is done, even if this caller was cancelled
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing left to count
                loop.call_soon_threadsafe(self._release_tokenizing, chars)

        work.add_done_callback(release)
        return await asyncio.wrap_future(work)

    def _release_tokenizing(self, chars: int) -> None:
        self._tokenizing_chars -= chars

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
