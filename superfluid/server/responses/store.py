"""Stored responses, on disk: SQLite (the stdlib's) under the server's state directory.

A row is one response: its object as the API shows it, its conversation's items through its
own output (so a later turn needs this row alone: evicting an older turn never breaks a newer
one), the conversation's cache key and retention (request.py's lease), and the token ids of
its prompt and output.

Bounds: at most ``max_stored`` responses and none older than ``max_age_s``; each write,
each read of an expired row and the opening sweep evict what is past them, oldest first,
and report it (``on_evict(reason, count)``: a log line and a Prometheus counter).

Every call here blocks (SQLite): the server runs them with ``asyncio.to_thread``. One
connection, serialized by a lock; WAL, so a killed server loses no committed response.
Without a state directory the store is in memory (not durable): ``create_app`` in tests.
"""

from __future__ import annotations

import array
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger("superfluid.server")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    conversation TEXT,
    retention TEXT,
    previous_id TEXT,
    object TEXT NOT NULL,
    items TEXT NOT NULL,
    token_ids BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
"""


@dataclass(frozen=True)
class StoreConfig:
    state_dir: str | None = None  # None: in memory
    max_stored: int = 10_000
    max_age_s: float = 30 * 86400.0  # OpenAI keeps stored responses 30 days


def _ids_blob(ids: list[int]) -> bytes:
    return array.array("i", ids).tobytes()


def _blob_ids(blob: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(blob)
    return a.tolist()


class ResponseStore:
    def __init__(self, config: StoreConfig = StoreConfig(), on_evict: Callable[[str, int], None] | None = None):
        self.config = config
        self.on_evict = on_evict
        self.path = ":memory:"
        if config.state_dir is not None:
            Path(config.state_dir).mkdir(parents=True, exist_ok=True)
            self.path = str(Path(config.state_dir) / "responses.sqlite3")
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        self.count = self._count()
        self.evict()  # what aged out while the server was down

    def _count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    # ------------------------------------------------------------ rows
    def put(self, obj: dict, items: list[dict], token_ids: list[int], conversation: str | None,
            retention: str | None) -> None:
        row = (obj["id"], time.time(), conversation, retention, obj.get("previous_response_id"),
               json.dumps(obj, ensure_ascii=False), json.dumps(items, ensure_ascii=False), _ids_blob(token_ids))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
        self.count = self._count()
        self.evict()

    def get(self, rid: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT created_at, conversation, retention, object, items, token_ids "
                                   "FROM responses WHERE id = ?", (rid,)).fetchone()
        if row is None:
            return None
        if time.time() - row[0] > self.config.max_age_s:
            self.evict()
            return None
        return {"id": rid, "created_at": row[0], "conversation": row[1], "retention": row[2],
                "object": json.loads(row[3]), "items": json.loads(row[4]), "token_ids": _blob_ids(row[5])}

    def delete(self, rid: str) -> bool:
        with self._lock:
            gone = self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0
        self.count = self._count()
        return gone

    # ------------------------------------------------------------ bounds
    def evict(self) -> None:
        """Delete what is past the age and count bounds, oldest first; report each kind."""
        cutoff = time.time() - self.config.max_age_s
        with self._lock:
            aged = self._db.execute("DELETE FROM responses WHERE created_at < ?", (cutoff,)).rowcount
            over = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] - self.config.max_stored
            counted = 0
            if over > 0:
                counted = self._db.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at, rowid LIMIT ?)",
                    (over,)).rowcount
        for reason, n in (("age", aged), ("count", counted)):
            if n > 0:
                self._report(reason, n)
        if aged or counted:
            self.count = self._count()

    def _report(self, reason: str, n: int) -> None:
        bound = (f"older than --responses-max-age {self.config.max_age_s:g} s" if reason == "age"
                 else f"past --responses-max-stored {self.config.max_stored}")
        log.warning("responses store: %d stored response%s evicted (%s)", n, "" if n == 1 else "s", bound)
        if self.on_evict is not None:
            self.on_evict(reason, n)

    def close(self) -> None:
        with self._lock:
            self._db.close()
