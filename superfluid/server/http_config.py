"""How ``superfluid serve`` runs uvicorn: the bounds on connections that no request
field can state.

- h11, not httptools: h11 has a header bound (``H11_MAX_HEADER_BYTES``); uvloop under it.
- ``limit_concurrency``: past that many open connections (or running requests) a new
  request is a 503, not one more task on the loop.
- A header deadline: a connection that has not completed its first request's headers
  within ``header_timeout_s`` is closed (uvicorn's keep-alive timeout covers the time
  between later requests), so idle or trickling connections cannot hold descriptors and
  concurrency slots forever.
- The soft descriptor limit is raised to the hard one at start, so a thousand idle
  connections do not leave the server (or a restarted worker's socket) without one.
"""

from __future__ import annotations

import ipaddress
import resource
import sys

from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import H11_MAX_HEADER_BYTES

LOOPBACK_NAMES = ("localhost",)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 16)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, key: str | None) -> str | None:
    """A warning for a server reachable from other machines with no credential."""
    if key or is_loopback(host):
        return None
    return (f"superfluid: WARNING: serving on {host} without an API key: anyone who can reach this address can "
            "use the API. Pass --api-key KEY (or set SUPERFLUID_API_KEY).")


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose first request's headers are not
    complete within ``header_timeout_s``."""

    class HeaderDeadline(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._header_timer is not None:
                self._header_timer.cancel()  # a request started: the deadline is met
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def uvicorn_config(app, args):
    """The uvicorn.Config of ``superfluid serve`` (one engine or a cluster's front door)."""
    import uvicorn

    warning = exposure_warning(args.host, getattr(args, "resolved_api_key", None))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    raise_fd_limit()
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout + 2.0,
        h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES,
        http=header_deadline_protocol(args.header_timeout), loop="auto",
        limit_concurrency=args.limit_concurrency or None,
    )
