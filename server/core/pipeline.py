"""The serving pipeline without transport: validate -> tokenize -> batch -> normalise.

Texts are tokenized by ``tokenize``; ``compute`` queues token rows, the tokenizer's or a client's
own (the Open Inference Protocol's token mode), into the same batches. The two steps are apart so a
front end can drop the request body in between: only the rows wait for the batch.

The front ends in server/api wrap it; tests and the benchmark can drive it directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from server.core.batcher import Batcher
from server.core.errors import BadInput, InvalidInput, TooManyInputs
from server.core.normalize import l2_normalize
from server.core.tokenizer import TextTokenizer, Token

MIN_TOKENS_PER_INPUT = 2  # [CLS] and [SEP]
INLINE_TOKENIZE_CHARS = 1024  # requests this short are tokenized on the event loop: cheaper than a thread hop


class PipelineObserver:
    """Hooks for metrics; the defaults do nothing. Called on the event loop thread."""

    def tokenized(self, seconds: float) -> None: ...

    def embedded(self, inputs: int, tokens: int) -> None: ...


@dataclass(frozen=True)
class Limits:
    max_client_batch_size: int
    max_input_chars: int


@dataclass(frozen=True)
class Tokenized:
    rows: list[np.ndarray]  # int64 token ids per input, special tokens included, no padding
    truncated: list[int]  # indices of inputs cut to the model's max length
    seconds: float


@dataclass(frozen=True)
class Embedded:
    embeddings: np.ndarray  # (n, dim) float32 in input order
    token_counts: list[int]
    truncated: list[int]
    tokenize_seconds: float
    queue_seconds: float
    inference_seconds: float


def check_count(n: int, limits: Limits) -> None:
    if n > limits.max_client_batch_size:
        raise TooManyInputs(n, limits.max_client_batch_size)


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
            raise BadInput(i, "is empty or only whitespace")
        if len(text) > limits.max_input_chars:
            raise BadInput(i, f"has {len(text)} characters, more than max_input_chars={limits.max_input_chars}")
        prepared.append(prepare(text))
    return prepared


class Pipeline:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        batcher: Batcher,
        limits: Limits,
        observer: PipelineObserver,
        tokenizer_threads: int,
        dim: int,
    ) -> None:
        self.dim = dim  # the model's embedding width; the backend's rows carry it twice (server/backend/ort.py)
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.limits = limits
        self.observer = observer
        self._tokenize_pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="tokenize")

    async def tokens(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[Token]]:
        """Each text's tokens, untruncated, under the same input limits as embeddings; off the event loop."""
        prepared = validate(texts, self.limits)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.tokens, prepared, add_special_tokens)

    async def tokenize(self, texts: Sequence[str], truncate: bool, client: str = "") -> Tokenized:
        """``texts`` may be the request message's own sequence: it is read, never kept whole.

        Once this returns the caller can drop the request body: only the token rows are needed.
        """
        prepared = validate(texts, self.limits, self.tokenizer.cut if truncate else str)
        # Refuse before paying for tokenization when the queue cannot take even the shortest version.
        self.batcher.check_room(MIN_TOKENS_PER_INPUT * len(texts), client)
        started = time.perf_counter()
        if sum(len(t) for t in prepared) <= INLINE_TOKENIZE_CHARS:
            # Cheaper than a thread hop, and a short request never waits behind long ones' tokenization.
            encoded = self.tokenizer.encode(prepared, truncate, texts)
        else:
            loop = asyncio.get_running_loop()
            encoded = await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, prepared, truncate, texts)
        seconds = time.perf_counter() - started
        self.observer.tokenized(seconds)
        return Tokenized(encoded.rows, encoded.truncated, seconds)

    async def compute(
        self,
        tokenized: Tokenized,
        normalize: bool,
        deadline: float | None,
        client: str = "",
        dimensions: int | None = None,
    ) -> Embedded:
        """Queue the rows (fairly among clients, see server/batcher.py) and wait for their embeddings.

        ``dimensions`` keeps the first d components, re-normalised when normalising (the shortened
        vector has unit length, unlike a cut of the normalised one).
        """
        rows, truncated, tokenize_seconds = tokenized.rows, tokenized.truncated, tokenized.seconds
        dim = self.dim
        if dimensions is not None and not 1 <= dimensions <= dim:
            raise InvalidInput(f"dimensions must be between 1 and {dim}, not {dimensions}")
        result = await self.batcher.submit(rows, deadline, client)
        if dimensions is not None and dimensions < dim:
            shortened = result.embeddings[:, :dimensions]
            embeddings = l2_normalize(shortened) if normalize else shortened
        else:
            embeddings = result.embeddings[:, dim:] if normalize else result.embeddings[:, :dim]
        counts = [len(r) for r in rows]
        self.observer.embedded(len(rows), sum(counts))
        return Embedded(
            embeddings=embeddings,
            token_counts=counts,
            truncated=truncated,
            tokenize_seconds=tokenize_seconds,
            queue_seconds=result.queue_seconds,
            inference_seconds=result.inference_seconds,
        )

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
