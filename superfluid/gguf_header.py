"""The counts a GGUF header declares, bounded before any runtime believes them.

Both runtimes read the header before they size or loop over anything: the torch loader in
Python, llama.cpp in C, where a crafted ``block_count`` is a GGML_ASSERT that aborts the
whole process (measured: 2**32-1 layers). So every architecture's counts are checked here
first, for any architecture name: the layers and the embedding width are positive (layers
up to llama.cpp's LLAMA_MAX_LAYERS, the width up to MAX_SIZE); every other count is in
[0, MAX_SIZE] (a Mamba file declares 0 heads and 0 feed-forward), as a scalar or as a
per-layer array (OpenELM, DeciLM) of at most MAX_LAYERS values.
"""

from __future__ import annotations

from pathlib import Path

from .models import MAX_SIZE, ModelLoadError, check_size

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS; the deepest model published has 126

_COUNTS = ("feed_forward_length", "attention.head_count", "attention.head_count_kv",
           "attention.key_length", "attention.value_length", "vocab_size", "expert_count",
           "expert_used_count", "expert_feed_forward_length", "attention.sliding_window")


def check_header(reader, path: Path) -> None:
    """Raise ModelLoadError naming ``path`` and the field when a declared count is out of bounds.
    ``reader``: an open gguf.GGUFReader."""
    source = str(path)
    f = reader.fields.get("general.architecture")
    if f is None:
        raise ModelLoadError(f"{source}: missing metadata field 'general.architecture'")
    arch = _contents(f, "general.architecture", source)
    if not isinstance(arch, str):
        raise ModelLoadError(f"{source}: field general.architecture is not a string")
    for name, limit in (("block_count", MAX_LAYERS), ("embedding_length", MAX_SIZE)):
        key = f"{arch}.{name}"
        if key in reader.fields:
            check_size(key, _contents(reader.fields[key], key, source), source, limit)
    for key in (f"{arch}.{k}" for k in _COUNTS):
        if key not in reader.fields:
            continue
        v = _contents(reader.fields[key], key, source)
        values = v if isinstance(v, list) else [v]
        if len(values) > MAX_LAYERS or not all(_count(x) for x in values):
            raise ModelLoadError(f"{source}: field {key} must be an integer in [0, {MAX_SIZE}] "
                                 f"(or a list of at most {MAX_LAYERS}), got {str(v)[:80]}")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_SIZE


def _contents(field, key: str, source: str):
    try:
        return field.contents()
    except Exception as e:
        raise ModelLoadError(f"{source}: unreadable metadata field {key!r} ({e})") from e


def check_file(path: Path) -> None:
    """check_header on the file at ``path``; an unreadable file is left to the runtime's own
    reader, which names it."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception:
        return
    check_header(reader, path)
