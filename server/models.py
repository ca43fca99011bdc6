"""The models a server serves: loading one, and the registry the servicers resolve names against.

Each model has its own ONNX Runtime session, tokenizer, batcher and pipeline, so a flood on one
model fills only that model's queue (docs/architecture.md, "Several models"). Nothing here knows
protobuf; the servicers turn these objects into their protocols' messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from contract.manifest import MANIFEST_FILE, MODEL_FILES, TOKENIZER_FILE, Manifest, cpu_model_path
from server.batcher import Batcher, BatchPolicy
from server.config import ServerConfig
from server.errors import NotReady, UnknownModel
from server.loops import IdlePoll
from server.pipeline import Pipeline
from server.runtime import OnnxRuntime, RuntimeOptions
from server.tokenize import TextTokenizer

VERSION = "0.1.0"
log = logging.getLogger(__name__)


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
class LoadedModel:
    runtime: OnnxRuntime
    tokenizer: TextTokenizer
    info: ModelInfo


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


def batch_token_budget(runtime: OnnxRuntime, config: ServerConfig, max_length: int) -> int:
    """--max-batch-tokens, lowered to what one batch of this model runs within --max-batch-seconds."""
    if config.max_batch_seconds <= 0:
        return config.max_batch_tokens
    return runtime.batch_tokens_within(config.max_batch_seconds, max_length, config.max_batch_tokens)


def batch_policy(
    config: ServerConfig, max_batch_tokens: int, batch_cost: tuple[float, float] = (0.0, 0.0), inline_tokens: int = 0
) -> BatchPolicy:
    """The batcher's policy for a model whose token budget is max_batch_tokens (batch_token_budget), whose
    batches cost batch_cost (OnnxRuntime.batch_cost; (0, 0): the budget does not follow the load) and whose
    batches of at most inline_tokens run on the event loop when nothing else is queued."""
    return BatchPolicy(
        max_batch_tokens=max_batch_tokens,
        max_batch_size=config.max_batch_size,
        max_queue_tokens=config.max_queue_tokens,
        max_delay=config.max_delay_seconds,
        max_padding_ratio=config.max_padding_ratio,
        max_batch_seconds=config.max_batch_seconds,
        fixed_batch_seconds=batch_cost[0],
        seconds_per_token=batch_cost[1],
        inline_batch_tokens=inline_tokens,
    )


def load_model(model_dir: str | Path, config: ServerConfig, name: str | None = None) -> LoadedModel:
    """Blocking: reads the artifacts, opens the ONNX Runtime session and warms it up."""
    model_dir = Path(model_dir)
    manifest = Manifest.read(model_dir)  # FileNotFoundError, or ManifestError for another schema version
    # The files opened below: the precision's graph and the one CPU sessions run (the same but for fp32).
    opened = {MODEL_FILES[config.precision], cpu_model_path(model_dir, config.precision).name}
    manifest.check_files(model_dir, [TOKENIZER_FILE, *sorted(opened)])
    tokenizer = TextTokenizer(model_dir / TOKENIZER_FILE)
    options = RuntimeOptions(
        config.provider, config.precision, config.intra_op_threads, spinning=config.intra_op_spinning
    )
    runtime = OnnxRuntime(model_dir, options, pad_id=manifest.pad_id)
    log.info("%s: %s on %s", manifest.model_id, runtime.model_path.name, runtime.provider)
    one_thread = runtime.use_one_thread_up_to(config.one_thread_batch_tokens, tokenizer.max_length)
    if one_thread:
        log.info("%s: batches of at most %d padded tokens run on one thread", manifest.model_id, one_thread)
    max_batch_tokens = batch_token_budget(runtime, config, tokenizer.max_length)
    runtime.warm_up(tokenizer.max_length, max_batch_tokens, config.max_batch_size)
    inline = runtime.tokens_within_alone(config.inline_batch_ms / 1000, tokenizer.max_length)
    if inline:
        log.info("%s: a text of at most %d tokens runs on the event loop when alone", manifest.model_id, inline)
    info = ModelInfo(
        name=name or manifest.model_id,
        model_id=manifest.model_id,
        model_version=manifest.model_version,
        dim=runtime.dim,
        max_input_length=tokenizer.max_length,
        vocab_size=manifest.vocab_size,
        execution_provider=runtime.provider,
        precision=runtime.precision,
        version=VERSION,
        max_batch_tokens=max_batch_tokens,
        inline_batch_tokens=inline,
        one_thread_batch_tokens=one_thread,
        trained_dimensions=manifest.trained_dimensions,
        exported_at=int((model_dir / MANIFEST_FILE).stat().st_mtime),
    )
    return LoadedModel(runtime, tokenizer, info)


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
