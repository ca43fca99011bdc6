"""Domain errors of the serving core. Each front end turns them into its protocol's status codes, with one table."""

from __future__ import annotations

from typing import Any


class EmbedError(Exception):
    """Base class: the message is safe to show to the client."""


class InvalidInput(EmbedError):
    """The request can never succeed as sent (empty, too many inputs, too long...)."""


class BadInput(InvalidInput):
    """One input of the request is at fault. Its index and the problem are kept apart so that each
    protocol names its own field: gRPC's ``inputs[i]`` (the message), OpenAI's ``input[i]``."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(f"inputs[{index}] {problem}")
        self.index = index
        self.problem = problem


class TooManyInputs(InvalidInput):
    """More inputs in one request than max_client_batch_size. The counts are kept apart, as BadInput's
    index is, so that each protocol names its own field."""

    def __init__(self, count: int, most: int) -> None:
        super().__init__(f"{count} inputs, more than max_client_batch_size={most}; split the request")
        self.count = count
        self.most = most


class UnknownModel(InvalidInput):
    """The request names a model this server does not serve."""


class BodyTooLarge(InvalidInput):
    """The request body is larger than the server reads (--max-message-bytes)."""


class Overloaded(EmbedError):
    """Admission control refused the request; retrying later may succeed."""


class NotReady(EmbedError):
    """The model is not loaded yet, or the server is draining."""


class DeadlineExceeded(EmbedError):
    """The client's deadline passed before the request's inputs were computed."""


class Cancelled(EmbedError):
    """The client went away; nothing more is computed for it."""


class InferenceFailed(EmbedError):
    """A batch failed in the backend; only that batch's requests see this."""


class Unauthenticated(EmbedError):
    """No valid credentials; nothing was computed."""


class Internal(EmbedError):
    """An unexpected failure inside the server; the details go to the server log, not to the client."""


def nearest_entry(table: dict[type[EmbedError], Any], error: EmbedError, default: Any = None) -> Any:
    """A protocol table's entry for the error's own class or its nearest listed base (BadInput ->
    InvalidInput), so a new subclass maps as its base does."""
    return next((table[k] for k in type(error).__mro__ if k in table), default)
