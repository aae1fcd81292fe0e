"""Whether a parsed call is a call of one of the request's tools, with arguments that
follow the tool's JSON schema (``jsonschema_rs``): in ``auto`` mode a call that is not
comes back as the text the model wrote, as vLLM does.

A schema's validator is built once per response, on the first call of that tool. Remote
``$ref``s are never fetched (the schema came from a client). A schema the validator
cannot build (xgrammar accepted it when the request was checked) is checked for an
object only.
"""

from __future__ import annotations

import json

import jsonschema_rs


def _no_fetch(uri: str):
    raise ValueError(f"remote $ref {uri!r} is not fetched")


class ToolSchemas:
    def __init__(self, functions: tuple[dict, ...]):
        self.params = {f["name"]: f["parameters"] for f in functions}
        self._validators: dict[str, object] = {}

    def arguments(self, name: str, args: object) -> str | None:
        """The call's arguments as JSON text, or None: not a valid call of a tool."""
        if name not in self.params:
            return None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        try:
            text = json.dumps(args, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # a Python literal JSON has no word for
            return None
        v = self._validator(name)
        if v is not None and not v.is_valid(json.loads(text)):  # JSON's own types (a tuple is a list)
            return None
        return text

    def _validator(self, name: str):
        if name not in self._validators:
            try:
                self._validators[name] = jsonschema_rs.validator_for(self.params[name], retriever=_no_fetch)
            except Exception:  # noqa: BLE001 - any schema it cannot build: the object check stands
                self._validators[name] = None
        return self._validators[name]
