"""What every family's parser shares: content scanning for the markers that open a call
region, regions read as they are written, and incremental bracket matchers.

A parser (``Scanner``) turns a choice's text, pushed piece by piece, into items: content
strings (settled: they can no longer begin a call) and ``Found`` regions (text that reads
as calls, with the text itself, which becomes content again if a call does not validate).

Invariants:
- Work per push is proportional to the new text: content is searched from the held-back
  tail (shorter than the longest marker) plus the new text; a region reads only the new
  text (its bracket matcher or close-marker search keeps its state); a region's pieces are
  joined once, when it ends.
- The items do not depend on how the text was cut into pushes: a marker split across
  pushes is held back until it is whole, a region ends at the same character however it
  was fed. So a streamed response reassembles to the whole one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Found:
    """A region that reads as calls: [(name, arguments)], arguments a dict or a JSON string."""

    calls: list[tuple[str, object]]
    raw: str  # the region as written, marker included


Item = str | Found


class Region(Protocol):
    def feed(self, text: str) -> int | None:
        """Read the region's next text; where in ``text`` it ended (exclusive; negative: that
        many characters before ``text``, which it gives back to be read as content), or
        None: it goes on."""
        ...

    def calls(self, raw: str, final: bool) -> list[tuple[str, object]] | None:
        """The calls of the ended region ``raw`` (marker included; ``final``: cut by the end of
        the text), or None: it is not a call and stays content."""
        ...


class Scanner:
    """Content, and the regions its markers open. ``opens`` open a region anywhere;
    ``leads`` only at a boundary: the start of the text, or right after a region that held
    calls, whitespace skipped (JSON or pythonic calls that are the whole answer)."""

    opens: tuple[str, ...] = ()
    leads: tuple[str, ...] = ()

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas  # tool name -> its parameters schema (for families whose values are untyped text)
        self._hold = ""  # content that may still begin a marker
        self._region: Region | None = None
        self._pieces: list[str] = []  # the open region's text so far, marker included
        self._lead = bool(self.leads)  # at a boundary where a lead marker opens a region
        self._markers = self.opens + self.leads

    def region(self, marker: str) -> Region:
        raise NotImplementedError

    def feed(self, text: str, final: bool) -> list[Item]:
        out: list[Item] = []
        while text:
            if self._region is None:
                text = self._content(text, out)
                continue
            end = self._region.feed(text)
            if end is None:
                self._pieces.append(text)
                break
            if end < 0:  # the region gives back some of what it had read
                whole = "".join(self._pieces) + text
                end += len(whole) - len(text)
                self._pieces, text = [whole[:end]], whole[end:]
            else:
                self._pieces.append(text[:end])
                text = text[end:]
            self._end_region(out, final=False)
        if final:
            if self._region is not None:
                self._end_region(out, final=True)
            if self._hold:
                out.append(self._hold)
                self._hold = ""
        return out

    def _end_region(self, out: list[Item], final: bool) -> None:
        raw = "".join(self._pieces)
        calls = self._region.calls(raw, final)
        self._region, self._pieces = None, []
        if calls:
            out.append(Found(calls, raw))
            self._lead = bool(self.leads)
        else:
            out.append(raw)

    def _content(self, text: str, out: list[Item]) -> str:
        """Content up to the first marker (which opens a region: the rest is returned for
        it), or all of it but a tail that may begin a marker (held back; returns '')."""
        s, self._hold = self._hold + text, ""
        if self._lead:
            j = len(s) - len(s.lstrip())
            if j == len(s):
                out.append(s)
                return ""
            rest = s[j:]
            for m in self.leads:
                if rest.startswith(m):
                    out.append(s[:j])
                    return self._open(m, rest[len(m):])
            if any(m.startswith(rest) for m in self.leads):
                out.append(s[:j])
                self._hold = rest
                return ""
            self._lead = False
        at, marker = _first(s, self.opens)
        if marker is not None:
            out.append(s[:at])
            return self._open(marker, s[at + len(marker):])
        keep = partial_suffix(s, self.opens)
        out.append(s[: len(s) - keep])
        self._hold = s[len(s) - keep:]
        return ""

    def _open(self, marker: str, rest: str) -> str:
        self._region = self.region(marker)
        self._pieces = [marker]
        self._lead = False
        return rest


def _first(s: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(s), None
    for m in markers:
        i = s.find(m, 0, best + len(m))
        if 0 <= i < best:
            best, found = i, m
    return best, found


def partial_suffix(s: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of ``s`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        lo = max(0, len(s) - len(m) + 1)
        i = s.find(m[0], lo)
        while i >= 0:  # the leftmost candidate in the window is the longest
            if m.startswith(s[i:]):
                best = max(best, len(s) - i)
                break
            i = s.find(m[0], i + 1)
    return best


class CloseSearch:
    """Where ``close`` first appears in text fed piece by piece (a close split across
    pieces is found): remembers only the last ``len(close) - 1`` characters."""

    def __init__(self, close: str):
        self.close = close
        self._tail = ""

    def feed(self, text: str) -> int | None:
        s = self._tail + text
        i = s.find(self.close)
        if i >= 0:
            return i + len(self.close) - len(self._tail)
        self._tail = s[-(len(self.close) - 1):] if len(self.close) > 1 else ""
        return None


_JSON_STOP = re.compile(r'["{}\[\]]')
_JSON_IN_STR = re.compile(r'["\\]')


class JsonEnd:
    """The end of one JSON object or array fed piece by piece (leading whitespace allowed).
    ``failed``: the value did not start with ``{`` or ``[``."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.failed = 0, False, False, False

    def feed(self, text: str) -> int | None:
        i, n = 0, len(text)
        if self.depth == 0:  # before the value: whitespace, then a container
            while i < n and text[i] in " \t\r\n":
                i += 1
            if i == n:
                return None
            if text[i] not in "{[":
                self.failed = True
                return i
        while i < n:
            if self.esc:
                self.esc, i = False, i + 1
                continue
            m = (_JSON_IN_STR if self.in_str else _JSON_STOP).search(text, i)
            if m is None:
                return None
            ch, i = m.group(), m.end()
            if self.in_str:
                self.esc, self.in_str = ch == "\\", ch != '"'
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None


_PY_STOP = re.compile(r"""['"()\[\]{}]""")


class PyEnd:
    """The end of one bracketed Python expression fed piece by piece, starting at its
    opening bracket: strings in either quote with backslash escapes."""

    def __init__(self):
        self.depth, self.quote, self.esc = 0, "", False

    def feed(self, text: str) -> int | None:
        i, n = 0, len(text)
        while i < n:
            if self.esc:
                self.esc, i = False, i + 1
                continue
            if self.quote:
                j = _next_of(text, i, self.quote)
                if j < 0:
                    return None
                self.esc, i = text[j] == "\\", j + 1
                if not self.esc:
                    self.quote = ""
                continue
            m = _PY_STOP.search(text, i)
            if m is None:
                return None
            ch, i = m.group(), m.end()
            if ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None


def _next_of(text: str, i: int, quote: str) -> int:
    """The next quote or backslash at or after ``i``; -1 if none."""
    a, b = text.find(quote, i), text.find("\\", i)
    if a < 0:
        return b
    return a if b < 0 else min(a, b)
