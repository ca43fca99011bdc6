"""Request ids: the label a caller quotes when it reports a failed call, and the server's log names beside it.

OpenAI's API answers every request with ``x-request-id``; gateways (Envoy, nginx) add one to what they forward.
A caller's own id comes back unchanged when it is 1-128 visible ASCII characters; anything else is replaced,
never refused: a request is not worth failing over its label.
"""

from __future__ import annotations

import itertools
import re
import secrets

REQUEST_ID = "x-request-id"
CALLERS_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")


class RequestIds:
    """The caller's id when it is a sane token, else ``req_`` and 32 hex digits, unique across restarts and
    ``--workers`` (a random half per process, a counter for the other)."""

    def __init__(self) -> None:
        self._prefix = f"req_{secrets.token_hex(8)}"
        self._count = itertools.count()

    def __call__(self, given: bytes | None) -> bytes:
        if given is not None and CALLERS_REQUEST_ID.fullmatch(given):
            return given
        return f"{self._prefix}{next(self._count):016x}".encode()
