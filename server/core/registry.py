"""The registry of served models the front ends resolve names against, and the server's serving state.

Each model has its own tokenizer, batcher and pipeline, so a flood on one model fills only that
model's queue. Nothing here knows a protocol; the front ends turn these objects into their messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.core.batcher import Batcher
from server.core.errors import NotReady, UnknownModel
from server.core.idle_poll import IdlePoll
from server.core.pipeline import Pipeline
from server.core.tokenizer import TextTokenizer

VERSION = "0.1.0"


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what requests call it: --model NAME, or the manifest's model_id
    model_id: str
    model_version: str
    dim: int
    max_input_length: int
    vocab_size: int
    execution_provider: str
    precision: str
    version: str
    max_batch_tokens: int  # this model's: --max-batch-tokens, lowered to run within --max-batch-seconds
    inline_batch_tokens: int  # one text of at most this many tokens runs within --inline-batch-ms
    one_thread_batch_tokens: int  # batches of at most this many padded tokens run on the one-thread CPU session
    trained_dimensions: tuple[int, ...]  # lengths built and measured to stand alone (the manifest's matryoshka_dims)
    exported_at: int  # Unix time its manifest.json was written (by the export): OpenAI's model `created`

    def trained_at(self, dimensions: int) -> bool:
        """Whether the model was built and measured to stand alone at this length (answers say so)."""
        return dimensions in self.trained_dimensions


@dataclass
class ServedModel:
    info: ModelInfo
    pipeline: Pipeline  # holds the model's tokenizer, batcher and metrics

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.pipeline.tokenizer

    @property
    def batcher(self) -> Batcher:
        return self.pipeline.batcher


class ServingState:
    """What the servicers need to know about the server's life: its models, ready, draining.

    Draining does not refuse requests here: every request that reached the server is served, and
    gRPC's own stop() refuses new calls at the transport (see EmbeddingServer.stop).
    """

    def __init__(self, idle_poll_seconds: float = 0.0) -> None:
        # Set once every model is loaded and warm: until then every model-bound call is NotReady.
        self.models: dict[str, ServedModel] = {}  # the default first
        # Other names a model answers to: the Triton repository's folder name (its model_id without the
        # owner, e.g. all-MiniLM-L6-v2), so a client written for that repository works unchanged.
        self.aliases: dict[str, str] = {}
        self.draining = False
        self.unhealthy: set[str] = set()  # models whose backend fails every batch now
        self.in_flight = 0  # RPCs inside a handler now; drain waits for this to reach 0
        self.idle_poll = IdlePoll(idle_poll_seconds, lambda: self.in_flight > 0)

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        """A request of either protocol left its handler; the last one in progress starts the loop's idle poll."""
        self.in_flight -= 1
        if not self.in_flight:
            self.idle_poll.start()

    @property
    def ready(self) -> bool:
        return bool(self.models) and not self.draining

    @property
    def healthy(self) -> bool:
        return not self.unhealthy

    def serve(self, models: list[ServedModel]) -> None:
        """Publish the loaded models at once, the default first."""
        served = {m.name: m for m in models}
        aliases = {}
        for m in models:
            short = m.info.model_id.rsplit("/", 1)[-1]
            if short not in served:
                aliases[short] = m.name
        self.aliases = aliases
        self.models = served

    def find(self, name: str) -> ServedModel | None:
        if not name:
            return next(iter(self.models.values()), None)
        return self.models.get(name) or self.models.get(self.aliases.get(name, ""))

    def resolve(self, name: str) -> ServedModel:
        """The model a request names; "" is the default. Unknown names are InvalidInput listing the served."""
        if not self.models:
            raise NotReady("the models are still loading; retry shortly")
        model = self.find(name)
        if model is None:
            raise UnknownModel(f"unknown model {name!r}; this server serves {', '.join(map(repr, self.models))}")
        return model
