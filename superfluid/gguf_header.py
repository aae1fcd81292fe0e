"""The counts a GGUF header declares, bounded before any runtime believes them.

Both runtimes read the header before they size or loop over anything: the torch loader in
Python, llama.cpp in C, where a crafted ``block_count`` is a GGML_ASSERT that aborts the
whole process (measured: 2**32-1 layers). So every architecture's counts are checked here
first, for any architecture name: a scalar count is a positive integer up to MAX_SIZE
(layers up to llama.cpp's LLAMA_MAX_LAYERS); a per-layer array (OpenELM, DeciLM) holds one
value per layer, each in [0, MAX_SIZE].
"""

from __future__ import annotations

from pathlib import Path

from .models import MAX_SIZE, ModelLoadError, check_size

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS; the deepest model published has 126

_COUNTS = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
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
    layers = reader.fields.get(f"{arch}.block_count")
    if layers is not None:
        check_size(f"{arch}.block_count", _contents(layers, f"{arch}.block_count", source), source, MAX_LAYERS)
    for key in (f"{arch}.{k}" for k in _COUNTS):
        if key not in reader.fields:
            continue
        v = _contents(reader.fields[key], key, source)
        if isinstance(v, list):
            if len(v) > MAX_LAYERS or not all(isinstance(x, int) and 0 <= x <= MAX_SIZE for x in v):
                raise ModelLoadError(f"{source}: field {key} must list at most {MAX_LAYERS} integers "
                                     f"in [0, {MAX_SIZE}]")
        else:
            check_size(key, v, source)


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
