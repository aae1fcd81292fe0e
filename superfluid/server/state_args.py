"""``superfluid serve``'s flags for what outlives a request: the state directory and the
responses store's bounds (responses/store.py), the resumable streams' (stream_hub.py); and
the request-shaping flags create_app takes with them (tool-call parser, request templates)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .responses.store import StoreConfig
from .stream_log import StreamConfig


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "superfluid" / "state")


def add_args(p: argparse.ArgumentParser) -> None:
    d, s = StoreConfig(), StreamConfig()
    p.add_argument("--state-dir", default=None,
                   help=f"where the server keeps its state: stored responses (default: {default_state_dir()})")
    p.add_argument("--responses-max-stored", type=int, default=d.max_stored,
                   help=f"stored responses kept; the oldest past it are evicted (default {d.max_stored})")
    p.add_argument("--responses-max-age", type=float, default=d.max_age_s, metavar="S",
                   help=f"seconds a stored response is kept (default {d.max_age_s:g}: 30 days)")
    p.add_argument("--stream-retention", type=float, default=s.retention_s, metavar="S",
                   help=f"seconds a finished stream stays resumable with Last-Event-ID (default {s.retention_s:g})")
    p.add_argument("--stream-grace", type=float, default=s.grace_s, metavar="S",
                   help="seconds a chat/completions stream whose client left keeps running, waiting for it to resume "
                        f"(0: aborted at once; stored responses streams always run on; default {s.grace_s:g})")
    p.add_argument("--stream-max-retained", type=int, default=s.max_streams,
                   help=f"finished streams kept resumable (default {s.max_streams})")
    p.add_argument("--stream-max-mb", type=float, default=s.max_bytes / (1 << 20),
                   help=f"memory for recorded stream events, MiB (default {s.max_bytes >> 20})")


def app_kwargs(args: argparse.Namespace) -> dict:
    """``create_app``'s keywords from the flags."""
    for name in ("responses_max_stored", "stream_max_retained"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("responses_max_age", "stream_retention", "stream_grace", "stream_max_mb"):
        if not getattr(args, name) >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative")
    store = StoreConfig(state_dir=args.state_dir or default_state_dir(), max_stored=args.responses_max_stored,
                        max_age_s=args.responses_max_age)
    streams = StreamConfig(retention_s=args.stream_retention, grace_s=args.stream_grace,
                           max_streams=args.stream_max_retained, max_bytes=int(args.stream_max_mb * (1 << 20)))
    return {"store": store, "streams": streams, "tool_call_parser": args.tool_call_parser,
            "trust_request_chat_template": args.trust_request_chat_template}
