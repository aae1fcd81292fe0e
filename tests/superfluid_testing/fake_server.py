"""A tiny OpenAI-compatible streaming server with no model, for testing the load generator.

Plain asyncio HTTP/1.1 (keep-alive, chunked SSE). Each request streams ``max_tokens``
chunks of one fake token ("tok "), waiting ``first_delay_s`` before the first and
``token_delay_s`` between the others, then a usage chunk when ``stream_options.include_usage``
asks for one. It records what the tests check: arrival times, bodies, the most requests
in flight at once.

    PYTHONPATH=tests python -m superfluid_testing.fake_server --port 8123
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class FakeServer:
    first_delay_s: float = 0.0
    token_delay_s: float = 0.0
    cached_tokens: int = 3  # reported in usage.prompt_tokens_details
    send_usage: bool = True  # False: behave like a server that never sends usage
    model: str = "fake-model"
    host: str = "127.0.0.1"
    port: int = 0
    # observations
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    _server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> "FakeServer":
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path in ("/health", "/v1/models"):
                    body = {"status": "ok"} if path == "/health" else {
                        "object": "list", "data": [{"id": self.model, "object": "model"}]}
                    await self._send_json(writer, 200, body)
                elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                    await self._stream(writer, json.loads(raw), chat=path.endswith("chat/completions"))
                else:
                    await self._send_json(writer, 404, {"error": {"message": "not found"}})
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, body: dict, chat: bool) -> None:
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

            async def event(obj) -> None:
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()

            n = int(body.get("max_tokens") or 16)
            if chat:
                await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(self.first_delay_s if i == 0 else self.token_delay_s)
                choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
                choice["finish_reason"] = "length" if i == n - 1 else None
                await event({"choices": [choice]})
            if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])) or len(
                    str(body.get("prompt", "")).split())
                await event({"choices": [], "usage": {
                    "prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                    "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}})
            await event(b"[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.in_flight -= 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--first-delay", type=float, default=0.02)
    ap.add_argument("--token-delay", type=float, default=0.005)
    a = ap.parse_args()

    async def serve() -> None:
        srv = await FakeServer(first_delay_s=a.first_delay, token_delay_s=a.token_delay, host=a.host, port=a.port).start()
        print(f"fake OpenAI server on {srv.url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
