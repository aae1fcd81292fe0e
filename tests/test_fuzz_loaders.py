"""Loader fuzzing (issue 11): tiny GGUFs and Hugging Face folders, mutated by hypothesis
(truncated, bytes flipped in the header and metadata, absurd dimensions and counts, huge
metadata arrays, NaN weights), either load or fail with ModelLoadError naming the file;
never another exception, never an allocation past a small multiple of the file, never a
hang (each load runs under a time limit)."""

from __future__ import annotations

import os

import resource
import signal
import struct
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid.models import ModelLoadError
from superfluid.runtimes.torch import TorchRuntime
from superfluid_testing.tiny import TinyModel, write_hf_folder

LOAD_S = 20


@contextmanager
def time_limit(seconds: int):
    def boom(*_):
        raise TimeoutError(f"a load took over {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(path: Path) -> None:
    with time_limit(LOAD_S):
        try:
            TorchRuntime(path, quant="none", dtype="float32", kv_cache_mb=1)
        except ModelLoadError as e:
            assert str(path.name) in str(e) or str(path) in str(e), e
            return


class Blob(bytes):
    def __repr__(self) -> str:  # hypothesis prints fixtures of failing cases: not 600 kB of them
        return f"<{len(self)} bytes of tiny GGUF>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    p = TinyModel(n_layers=1, hidden=64, ffn=128).write_gguf(tmp_path_factory.mktemp("fuzz") / "t.gguf")
    return Blob(p.read_bytes())


def test_a_huge_context_length_allocates_no_huge_rope_table(tmp_path):
    """Found by the fuzzer: an absurd value over llama.context_length made the runtime build
    RoPE tables for every position the file claims (gigabytes). They now stop at the
    positions the runtime serves."""
    path = TinyModel(n_layers=1, hidden=64, ffn=128, context=(1 << 32) - 1).write_gguf(tmp_path / "long.gguf")
    rt = TorchRuntime(path, quant="none", dtype="float32", kv_cache_mb=1)
    assert rt.model.cos.shape[0] == rt.desc.max_seq_len <= 8192


# derandomize: the suite runs the same examples every time (a random search found a mutant
# whose load outlived the 20 s alarm under a loaded machine, once in three full runs, and
# was not reproduced in 400 tries since; SUPERFLUID_FUZZ_RANDOM=1 searches afresh)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=not os.environ.get("SUPERFLUID_FUZZ_RANDOM"))
@given(data=st.data())
def test_mutated_ggufs_load_or_name_the_file(tiny, tmp_path_factory, data):
    blob = bytearray(tiny)
    kind = data.draw(st.sampled_from(["truncate", "flip", "u64", "nan"]))
    if kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "flip":  # anywhere in the header, metadata and tensor infos
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, min(len(blob), 4096) - 1))
            blob[i] = data.draw(st.integers(0, 255))
    elif kind == "u64":  # an absurd count, length or dimension where a u64 sits in the header
        i = data.draw(st.integers(8, min(len(blob), 4096) - 8))
        blob[i: i + 8] = struct.pack("<Q", data.draw(st.sampled_from([2**31, 2**40, 2**63 - 1, 2**64 - 1])))
    else:  # NaN in the weights (the tail of the file is tensor data)
        arr = np.frombuffer(bytes(blob[-4096:]), dtype=np.float32).copy()
        arr[data.draw(st.integers(0, len(arr) - 1))] = np.nan
        blob[-4096:] = arr.tobytes()
    path = tmp_path_factory.mktemp("m") / "mutant.gguf"
    path.write_bytes(bytes(blob))
    load(path)


def test_nan_weights_are_refused_naming_file_and_tensor(tiny, tmp_path):
    blob = bytearray(tiny)
    arr = np.frombuffer(bytes(blob[-256:]), dtype=np.float32).copy()
    arr[3] = np.nan
    blob[-256:] = arr.tobytes()
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(ModelLoadError, match=r"nan\.gguf.*(NaN|non-finite)"):
        TorchRuntime(path, quant="none", dtype="float32", kv_cache_mb=1)


@pytest.fixture(scope="module")
def hf_template(tiny, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("hf")
    (d / "t.gguf").write_bytes(tiny)
    folder = write_hf_folder(d / "t.gguf", d / "model")
    AutoTokenizer.from_pretrained(d, gguf_file="t.gguf").save_pretrained(folder)
    TorchRuntime(folder, quant="none", dtype="float32", kv_cache_mb=1)  # unmutated, it loads
    return folder


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_hf_folders_load_or_name_the_file(hf_template, tmp_path_factory, data):
    import json
    import shutil

    folder = Path(shutil.copytree(hf_template, tmp_path_factory.mktemp("hf") / "model"))
    cfg_path, st_path = folder / "config.json", folder / "model.safetensors"
    kind = data.draw(st.sampled_from(["config", "truncate", "header", "nan"]))
    if kind == "config":
        cfg = json.loads(cfg_path.read_text())
        key = data.draw(st.sampled_from(sorted(cfg)))
        cfg[key] = data.draw(st.sampled_from([-1, 0, 2**40, "x", None, [1, 2], 1e308]))
        cfg_path.write_text(json.dumps(cfg))
    elif kind == "truncate":
        blob = st_path.read_bytes()
        st_path.write_bytes(blob[: data.draw(st.integers(0, len(blob) - 1))])
    elif kind == "header":  # the safetensors header length (its first 8 bytes)
        blob = bytearray(st_path.read_bytes())
        blob[:8] = struct.pack("<Q", data.draw(st.sampled_from([0, 7, 2**40, 2**64 - 1])))
        st_path.write_bytes(bytes(blob))
    else:
        blob = bytearray(st_path.read_bytes())
        arr = np.frombuffer(bytes(blob[-1024:]), dtype=np.float32).copy()
        arr[data.draw(st.integers(0, len(arr) - 1))] = np.nan
        blob[-1024:] = arr.tobytes()
        st_path.write_bytes(bytes(blob))
    before = max_rss_mb()
    with time_limit(LOAD_S):
        try:
            TorchRuntime(folder, quant="none", dtype="float32", kv_cache_mb=1)
            assert kind == "config", f"a {kind} mutant loaded"
        except ModelLoadError as e:
            assert str(folder) in str(e) or folder.name in str(e), e
    assert max_rss_mb() - before < 512


def test_a_corrupt_metadata_string_names_the_file(tiny, tmp_path):
    """Found by the fuzzer: a flipped byte inside a tokenizer string (invalid UTF-8) escaped
    as a bare UnicodeDecodeError."""
    blob = bytearray(tiny)
    at = blob.index(b"tokenizer.ggml.tokens") + 40  # inside the token strings that follow the key
    blob[at] = 0x9C
    path = tmp_path / "badutf8.gguf"
    path.write_bytes(bytes(blob))
    load(path)  # loads, or raises ModelLoadError naming the file; nothing else


def _set_u32(blob: bytes, key: str, value: int) -> bytes:
    """The file with metadata ``key`` (a uint32 field) set to ``value``: after the key come
    its value type (u32 4) and the value."""
    out = bytearray(blob)
    at = out.index(key.encode()) + len(key)
    assert struct.unpack_from("<I", out, at)[0] == 4, "not a uint32 field"
    struct.pack_into("<I", out, at + 4, value)
    return bytes(out)


@pytest.mark.parametrize("key,value", [("llama.block_count", 2**32 - 1), ("llama.block_count", 0),
                                       ("llama.feed_forward_length", 2**31), ("llama.attention.head_count", 0),
                                       ("llama.embedding_length", 2**32 - 1), ("llama.context_length", 0)])
def test_a_crafted_header_count_is_refused_at_once_naming_the_field(tiny, tmp_path, key, value):
    """Issue 23: the GGUF loader bounds every count the header declares before anything is
    looped over or sized by it, as the HF loader does (2**32-1 layers spun in expected_shapes
    until the load timeout)."""
    import time

    path = tmp_path / "crafted.gguf"
    path.write_bytes(_set_u32(tiny, key, value))
    t0 = time.monotonic()
    with time_limit(LOAD_S), pytest.raises(ModelLoadError, match=rf"crafted\.gguf: field {key} must be"):
        TorchRuntime(path, quant="none", dtype="float32", kv_cache_mb=1)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("key,value", [("llama.block_count", 2**32 - 1), ("llama.feed_forward_length", 2**31)])
def test_the_llamacpp_runtime_refuses_a_crafted_count_instead_of_aborting(tiny, tmp_path, key, value):
    """llama.cpp meets 2**32-1 layers with a GGML_ASSERT that aborts the process (the worker,
    in a server). The header is checked first. In a child process, so that a regression is a
    failed test rather than a dead test run."""
    import subprocess
    import sys

    path = tmp_path / "crafted.gguf"
    path.write_bytes(_set_u32(tiny, key, value))
    code = ("from superfluid.runtimes.llamacpp import load_runtime\n"
            "from superfluid.models import ModelLoadError\n"
            f"try:\n    load_runtime({str(path)!r})\nexcept ModelLoadError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"REFUSED {path}: field {key} must be" in out.stdout
