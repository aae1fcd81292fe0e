"""The few llama.cpp calls that load a model and make a context, with llama.cpp's own
error messages kept so that a file that does not load names the file and the reason.

llama.cpp reports load errors only through its log callback (the load functions
return NULL). We install one callback for the process: errors and warnings are kept
in a short ring (and warnings and errors go to stderr); the chatty info lines do not.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L

from ...models import ModelLoadError

_LEVEL_WARN, _LEVEL_ERROR, _LEVEL_CONT = 3, 4, 5
_recent: collections.deque[str] = collections.deque(maxlen=32)
_lock = threading.Lock()
_state = {"ready": False, "last_level": 0, "echo": os.environ.get("SUPERFLUID_LLAMA_LOG", "") == "1"}


@L.llama_log_callback
def _on_log(level: int, text: bytes, user_data) -> None:  # runs on llama.cpp's threads too
    if level == _LEVEL_CONT:
        level = _state["last_level"]
    _state["last_level"] = level
    msg = (text or b"").decode("utf-8", "replace")
    if level >= _LEVEL_WARN:
        with _lock:
            _recent.append(msg.strip())
    if _state["echo"] or level >= _LEVEL_ERROR:
        sys.stderr.write("llama.cpp: " + msg if not msg.startswith(" ") else msg)


def init_backend() -> None:
    """Once per process: the log callback (kept alive by the module), then the backend."""
    if _state["ready"]:
        return
    L.llama_log_set(_on_log, ctypes.c_void_p())
    L.llama_backend_init()
    _state["ready"] = True


def recent_errors() -> str:
    with _lock:
        lines = [m for m in _recent if m]
        _recent.clear()
    return "; ".join(lines[-4:])


def _forget_log() -> None:
    with _lock:
        _recent.clear()


def load_model(path: Path, extra_bufts: bool = False):
    """A llama_model pointer for the file (CPU); ModelLoadError naming the file.

    extra_bufts: llama.cpp's repacked weight layouts (AMX, AVX repacks). Off by default:
    on this project's Xeon VMs the AMX matmul segfaults on any batch of two or more
    tokens (ggml_backend_amx_mul_mat), which would take the worker down on every prefill."""
    init_backend()
    _forget_log()
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = extra_bufts
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        why = recent_errors() or "llama.cpp could not load it"
        raise ModelLoadError(f"{path}: llama.cpp cannot load this GGUF ({why})")
    return model


@dataclass(frozen=True)
class ContextSpec:
    n_ctx: int  # KV cells (one unified pool over every sequence)
    n_batch: int  # tokens one llama_decode may carry
    n_ubatch: int  # tokens per physical micro-batch
    n_seq_max: int  # sequence ids [0, n_seq_max); recurrent: that many states
    n_threads: int
    kv_f32: bool = False  # the reference numerics: fp32 K/V, no flash attention (its CPU kernel rounds Q to fp16)


def new_context(model, spec: ContextSpec, path: Path):
    """A llama_context with one unified KV pool, so that seq_cp shares cells."""
    p = L.llama_context_default_params()
    p.n_ctx = spec.n_ctx
    p.n_batch = spec.n_batch
    p.n_ubatch = spec.n_ubatch
    p.n_seq_max = spec.n_seq_max
    p.n_threads = p.n_threads_batch = spec.n_threads
    p.n_outputs_max = 0  # n_batch: step_rows asks for a row at every position
    p.n_outputs_max_per_seq = 0
    p.kv_unified = True  # seq_cp shares cells instead of copying them per stream
    p.swa_full = True  # sliding-window layers keep every cell: a prefix copy or cut stays exact
    p.no_perf = True
    if spec.kv_f32:
        p.type_k = p.type_v = 0  # GGML_TYPE_F32
        p.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    _forget_log()
    ctx = L.llama_init_from_model(model, p)
    if not ctx:
        why = recent_errors() or "no context"
        raise ModelLoadError(f"{path}: llama.cpp cannot make a context for it ({why})")
    return ctx


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
