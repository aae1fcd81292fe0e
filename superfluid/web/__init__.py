"""The chat page at ``/``: static HTML, CSS and plain JavaScript, no build step, no CDN.

The page is a client of the public API like any other (``/v1/models``,
``/v1/chat/completions`` streamed); the server only hands out its files. It is not
secret, so its routes take no key even when the API does, and they stay out of the
OpenAPI schema: the page adds files, never API behaviour.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

HERE = Path(__file__).resolve().parent

# Every file the page loads, by the name it is served under (/web/<name>); nothing else
# under this folder is reachable.
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# no-cache: revalidate on every load, so a newer server's page is never mixed with an older script
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def install(app: FastAPI) -> None:
    # read once: a few KiB, and a missing file fails at startup, not on the first visit
    page = (HERE / "index.html").read_bytes()
    files = {name: (HERE / name).read_bytes() for name in ASSETS}

    @app.get("/", include_in_schema=False)
    async def index():
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    for name, media_type in ASSETS.items():
        _asset_route(app, name, files[name], media_type)


def _asset_route(app: FastAPI, name: str, body: bytes, media_type: str) -> None:
    @app.get(f"/web/{name}", include_in_schema=False, name=f"web_{name}")
    async def asset():
        return Response(body, media_type=media_type, headers=_HEADERS)
