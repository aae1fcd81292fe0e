"""Stop strings across token boundaries.

The checker sees the generated text grow one delta at a time and decides how much
of it may be released to the client. Invariant: released text never contains a
stop string, and never ends with text that could still become the start of one
(that tail is held back until the next delta decides it). When a stop string
appears, the text is cut where it begins (or after it, with
``include_stop_str_in_output``) and nothing after it is ever released.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stops: tuple[str, ...] | list[str], include_in_output: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include_in_output
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything generated so far (until a stop cuts it)
        self.released = 0  # chars of self.text handed out
        self.stopped: str | None = None  # the stop string that matched
        self._floor = 0  # a match starts at or past here: text pushed unarmed was released as it came

    def push(self, delta: str, armed: bool = True) -> str:
        """Add generated text; returns the text that may be released now. Unarmed (before
        min_tokens) the text is released whole and no stop string may start in it."""
        if self.stopped is not None or not delta:
            return ""
        if not armed:
            self.text += delta
            self._floor = len(self.text)
            return self._release(len(self.text))
        start = max(0, len(self.text) - self._longest + 1, self._floor)  # a match must end in the delta
        self.text += delta
        if self.stops:
            hit = self._find(start)
            if hit is not None:
                at, stop = hit
                self.stopped = stop
                self.text = self.text[: at + len(stop)] if self.include else self.text[:at]
                return self._release(len(self.text))
            return self._release(len(self.text) - self._held_tail())
        return self._release(len(self.text))

    def flush(self) -> str:
        """The generation ended without a stop: release what was held back."""
        if self.stopped is not None:
            return ""
        return self._release(len(self.text))

    def _find(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop."""
        text = self.text
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out
