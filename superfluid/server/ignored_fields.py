"""Request fields the server accepts and ignores, made visible to an operator.

OpenAI's clients send fields newer than this server, so an unknown field is never a
400. Each name (dotted for a nested one, list positions dropped: ``messages.refusal``) is
logged once and counted in ``superfluid_ignored_request_fields_total{field}``.

Invariant: the label set is bounded. Past ``MAX_NAMES`` distinct names (a client
could send a million), further new names count as ``<other>`` and are not logged.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterator

from pydantic import BaseModel

log = logging.getLogger("superfluid.server")

MAX_NAMES = 64
MAX_WALK = 4096  # models looked at per request (a request has at most a few thousand messages' parts)
OTHER = "<other>"


def unknown_names(body: BaseModel) -> Iterator[str]:
    """Dotted names of the unknown fields of ``body`` and the models inside it."""
    stack: list[tuple[str, object]] = [("", body)]
    seen = 0
    while stack and seen < MAX_WALK:
        prefix, node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend((prefix, x) for x in node)
            continue
        if not isinstance(node, BaseModel):
            continue
        seen += 1
        for name in node.model_extra or ():
            yield prefix + name
        for name in type(node).model_fields:
            value = getattr(node, name)
            if isinstance(value, (BaseModel, list, tuple)):
                stack.append((f"{prefix}{name}.", value))


class IgnoredFields:
    def __init__(self, counter):
        self._counter = counter  # a prometheus Counter labelled by field
        self._names: set[str] = set()
        self._lock = threading.Lock()  # requests are parsed on the loop and in a thread pool

    def note(self, body: BaseModel, endpoint: str) -> None:
        for name in set(unknown_names(body)):
            with self._lock:
                new = name not in self._names
                if new and len(self._names) >= MAX_NAMES:
                    name, new = OTHER, False
                elif new:
                    self._names.add(name)
            if new:
                log.warning("%s: the request field %r is accepted and ignored (logged once)", endpoint, name)
            self._counter.labels(name).inc()
