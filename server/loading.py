"""Loading a model for serving: its artifacts read and checked, its ONNX Runtime session opened, measured
and warmed up, and the batcher's policy from the server's configuration."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from contract.manifest import MANIFEST_FILE, MODEL_FILES, TOKENIZER_FILE, Manifest, cpu_model_path
from server.backend.ort import OnnxRuntime, RuntimeOptions
from server.config import ServerConfig
from server.core.batcher import BatchPolicy
from server.core.registry import VERSION, ModelInfo
from server.core.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    runtime: OnnxRuntime
    tokenizer: TextTokenizer
    info: ModelInfo


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
