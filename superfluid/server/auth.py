"""``--api-key``: a bearer credential for the API, as vLLM and llama-server have.

Every ``/v1/*`` route (the cluster's drain route among them) and ``/tokenize`` /
``/detokenize`` need ``Authorization: Bearer KEY``; anything else is a 401 in OpenAI's
error shape, answered before the app reads the body. ``/health``, ``/metrics`` and the
chat page stay open: a probe, a scraper and a browser need no key (the page asks for
it and sends it with each API call). The key is compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import os

from .errors import error_body

ENV = "SUPERFLUID_API_KEY"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def api_key(flag: str | None) -> str | None:
    """The key in force: the flag's, else the environment's; None: the API is open."""
    key = flag if flag else os.environ.get(ENV)
    return key or None


def protected(path: str) -> bool:
    return path == "/v1" or path.startswith(PROTECTED_PREFIXES)


class ApiKey:
    """ASGI middleware: a protected route without the key is a 401 (WWW-Authenticate: Bearer)."""

    def __init__(self, app, key: str):
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and protected(scope.get("path", "")):
            got = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):
                return await _unauthorized(send, bool(got))
        return await self.app(scope, receive, send)


async def _unauthorized(send, had_header: bool) -> None:
    message = ("Incorrect API key provided." if had_header
               else "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.")
    payload = json.dumps(error_body(message, "authentication_error", None, "invalid_api_key")).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": payload})
