"""``--runtime auto`` (the default): the runtime that runs this file, and why.

torch (the fast default route) when it runs the file's architecture and every tensor type
in it; otherwise llamacpp, which loads any GGUF llama.cpp knows. A Hugging Face folder is
torch's or nobody's (llama.cpp reads GGUF only). The reason is a sentence for the start-up
line and ``/health``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..models import ModelLoadError, resolve_model


def pick_runtime(model: str | Path) -> tuple[str, str]:
    """("torch" | "llamacpp", why). Raises ModelLoadError for a folder torch cannot run."""
    from .torch.config import ARCHITECTURES

    path = resolve_model(model)
    if path.suffix != ".gguf":
        try:
            arch = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return "torch", "a Hugging Face folder (torch reads it and names what is wrong)"
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: architecture {arch!r} (config.json model_type) is not one the torch "
                                 f"runtime runs ({', '.join(ARCHITECTURES)}), and the llamacpp runtime reads GGUF "
                                 f"files only: convert it with llama.cpp's convert_hf_to_gguf.py")
        return "torch", f"torch runs {arch} from a Hugging Face folder"
    from .torch.gguf_weights import GGUF_ARCHITECTURES

    return _pick_gguf(path, tuple(GGUF_ARCHITECTURES))


def _pick_gguf(path: Path, architectures: tuple[str, ...]) -> tuple[str, str]:
    from gguf import GGMLQuantizationType, GGUFReader

    from .torch.gguf_weights import SUPPORTED_QUANTS

    try:
        reader = GGUFReader(path)
        f = reader.fields.get("general.architecture")
        arch = f.contents() if f is not None else None
        types = {int(t.tensor_type) for t in reader.tensors}
    except Exception:
        return "torch", "an unreadable GGUF (torch's loader names what is wrong)"
    if arch not in architectures:
        return "llamacpp", f"architecture {arch!r} is not one torch runs ({', '.join(architectures)})"
    other = sorted(types - {int(q) for q in SUPPORTED_QUANTS})
    if other:
        names = ", ".join(GGMLQuantizationType(t).name if t in GGMLQuantizationType._value2member_map_ else str(t)
                          for t in other)
        return "llamacpp", f"tensor types {names} are not ones torch reads"
    return "torch", f"torch runs {arch} with this file's tensor types"
