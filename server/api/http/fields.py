"""The fields of the HTTP API's JSON requests, read and checked: OpenAI's `/v1/embeddings` and TEI's `/embed`.

Every malformed field is a ``ParamError`` naming it (OpenAI's ``param``), with a message that says what
the field must be and what it was, in JSON's words.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from server.core.errors import InvalidInput
from server.core.registry import ServedModel

ENCODING_FORMATS = ("float", "base64")


class ParamError(InvalidInput):
    """Invalid input naming the request field at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


JSON_NAMES = {int: "an integer", str: "a string", bool: "a boolean"}


def optional_field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """An optional field; JSON null counts as not given, as clients that serialise every field send it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ParamError(f"'{name}' must be {JSON_NAMES[kind]}; it is {json_kind(value)}", name)
    return value


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words, for error messages."""
    if value is None:
        return "missing or null"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (dict, "an object"))
    return next(name for kind, name in kinds if isinstance(value, kind))


def parse_input(value: Any, field: str = "input") -> list[str] | list[list[int]]:
    """The inputs of OpenAI's `input` (or TEI's `inputs`): a string, strings, token ids, or lists of token ids
    -> texts or token rows."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        kind = json_kind(value)
        raise ParamError(f"'{field}' must be a string, a list of strings, or token ids; it is {kind}", field)
    forms = [_form(v) for v in value]
    if all(form == "text" for form in forms):
        return value
    if all(form == "id" for form in forms):
        return [value]
    if all(form == "ids" for form in forms):
        empty = next((i for i, r in enumerate(value) if not r), None)
        if empty is None:
            return value
        raise ParamError(f"{field}[{empty}] is an empty list of token ids", field)
    # Name the first item that no form of the field holds, or that differs in form from its first item.
    i = next((i for i, form in enumerate(forms) if form is None or form != forms[0]), 0)
    said = f"{field}[{i}] is {_what(value[i])}" + (f", {field}[0] {_what(value[0])}" if forms[i] else "")
    raise ParamError(
        f"'{field}' must be a string, a list of strings, a list of token ids or a list of such lists; {said}", field
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _form(item: Any) -> str | None:
    """What an item of a list `input` is: a text, a token id, a list of token ids, or none of them."""
    if isinstance(item, str):
        return "text"
    if _is_id(item):
        return "id"
    return "ids" if isinstance(item, list) and all(_is_id(v) for v in item) else None


def _what(item: Any) -> str:
    if isinstance(item, float):
        return "a number that is not an integer"
    if isinstance(item, list) and not all(_is_id(v) for v in item):
        return f"a list holding {_what(next(v for v in item if not _is_id(v)))}"
    return json_kind(item)


def token_rows(rows: list[list[int]], model: ServedModel, field: str = "input") -> list[np.ndarray]:
    """Token id rows as the model's tokenizer makes them (special tokens included), checked against it."""
    info = model.info
    for i, row in enumerate(rows):
        if len(row) > info.max_input_length:
            raise ParamError(  # whatever `truncate` says: a cut row would lose its closing special token
                f"{field}[{i}] has {len(row)} tokens, more than the limit of {info.max_input_length}; token ids are "
                f"never cut, truncate or not: send at most {info.max_input_length}",
                field,
            )
        if min(row) < 0 or max(row) >= info.vocab_size:
            raise ParamError(f"{field}[{i}] holds a token id outside the vocabulary [0, {info.vocab_size})", field)
    return [np.asarray(row, dtype=np.int64) for row in rows]


def openai_fields(body: dict[str, Any]) -> str:
    """`/v1/embeddings`' own fields: its encoding_format; `user` accepted and ignored, as OpenAI documents it."""
    encoding: str = optional_field(body, "encoding_format", str, "float")
    if encoding not in ENCODING_FORMATS:
        raise ParamError(f"'encoding_format' must be float or base64, not {encoding!r}", "encoding_format")
    optional_field(body, "user", str, None)
    return encoding


def tei_fields(body: dict[str, Any]) -> int:
    """`/embed`'s own fields, checked: texts are cut at the end only, and the models have no prompts. Returns
    the inputs' characters (TEI's `x-compute-characters`; 0 for token ids), read after `inputs` was checked."""
    direction = optional_field(body, "truncation_direction", str, "right")
    if direction.lower() != "right":
        raise ParamError(f"'truncation_direction' must be right, not {direction!r}: inputs are cut at the end only",
                         "truncation_direction")  # fmt: skip
    if optional_field(body, "prompt_name", str, None) is not None:
        raise ParamError("'prompt_name': the served models have no prompts; prepend the text", "prompt_name")
    inputs = body["inputs"]
    return len(inputs) if isinstance(inputs, str) else sum(len(x) for x in inputs if isinstance(x, str))
