"""Page arithmetic: runtimes hand out KV cells in whole pages (blocks) of ``page`` cells.

A leaf: the scheduler's planner (engine side) and the executor's capacity check both
count cells this way, so that the plans the one builds are the plans the other admits.
A ``page`` below 1 (a runtime that does not page, or an exact-only recurrent state)
counts cells one by one.
"""

from __future__ import annotations


def pages_for(tokens: int, page: int) -> int:
    """Pages that hold ``tokens`` tokens: ceil(tokens / page)."""
    page = max(page, 1)
    return -(-tokens // page)


def cells_for(tokens: int, page: int) -> int:
    """Cells that ``tokens`` tokens take in whole pages."""
    return pages_for(tokens, page) * max(page, 1)


def blocks_added(held: int, add: int, page: int) -> int:
    """Pages a sequence holding ``held`` tokens takes to hold ``add`` more: the new
    tokens first fill the partial last page, then open new ones."""
    return pages_for(held + add, page) - pages_for(held, page)


def cells_added(held: int, add: int, page: int) -> int:
    """Cells (in whole pages) a sequence holding ``held`` tokens takes to hold ``add`` more."""
    return blocks_added(held, add, page) * max(page, 1)
