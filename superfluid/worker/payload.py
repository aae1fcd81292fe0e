"""A runtime's sequence payload (``seq_export``) as msgpack can carry it.

The toy's payload is plain data; the torch runtime's holds tensors (k, v on the host),
which become ``{"__tensor__": [dtype, shape, raw bytes]}`` and come back as tensors of
the same dtype and shape. No pickle: the payload crosses the worker's msgpack wire and,
between replicas, Ray.
"""

from __future__ import annotations

from typing import Any

_TAG = "__tensor__"


def encode(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        import torch

        t = obj.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TAG: [str(t.dtype).removeprefix("torch."), list(t.shape), raw]}
    return obj


def decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _TAG in obj and len(obj) == 1:
            import torch

            dtype, shape, raw = obj[_TAG]
            dt = getattr(torch, dtype)
            if not raw:
                return torch.empty(shape, dtype=dt)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj
