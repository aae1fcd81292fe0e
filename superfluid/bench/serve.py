"""A load generator for any OpenAI-compatible server (superfluid, llama-server, vLLM, ...).

Streams every request with ``httpx.AsyncClient`` and times it on the client:

    TTFT   send -> first chunk carrying output text
    ITL    gaps between consecutive chunks carrying output text (pooled over requests)
    TPOT   per request: (e2e - TTFT) / (output tokens - 1)
    E2E    send -> end of stream

Load is a fixed concurrency (``max_concurrency`` requests in flight) and/or a Poisson
arrival process (``request_rate`` requests/s; inf: all at once, bounded by concurrency).
A session's turns (the multi-turn dataset) go one after another, each with the answers
the server gave to the turns before it. Output tokens come from the usage chunk
(``stream_options.include_usage``) when the server sends one, else from the number of
content chunks (one token a chunk, as both superfluid and llama-server stream). Cached
prompt tokens come from ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import httpx
import numpy as np

from .datasets import BenchRequest

PERCENTILES = (50, 90, 99)
SCHEMA = "superfluid.bench.serve/1"
# The keys every serving result has (tests check them; compare.py reads them).
RESULT_KEYS = (
    "schema", "label", "base_url", "endpoint", "model", "dataset", "seed", "num_requests",
    "max_concurrency", "request_rate", "ignore_eos", "temperature", "started_at",
    "completed", "failed", "errors", "duration_s", "requests_per_s", "output_tokens_per_s",
    "total_tokens_per_s", "total_input_tokens", "total_output_tokens", "cached_prompt_tokens",
    "cached_ratio", "output_tokens_source", "max_in_flight",
    "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms",
)
STAT_KEYS = ("mean", "p50", "p90", "p99")


@dataclass
class BenchConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None  # None: the first of /v1/models
    endpoint: str = "chat"  # "chat" | "completions"
    max_concurrency: int | None = 8  # None: unbounded
    request_rate: float = math.inf  # Poisson arrivals per second; inf: no pacing
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    seed: int = 0  # for the arrival process
    timeout_s: float = 600.0
    label: str = ""
    dataset: str = ""
    progress: bool = True
    keep_requests: bool = False  # per-request records in the result


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0  # send time, from the start of the run
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # content-chunk arrivals, from send
    output_tokens: int = 0
    tokens_from_usage: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""


def api_root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Send times (s from the start) of ``n`` requests at ``rate``/s; all zero when rate is inf."""
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError("request_rate must be positive")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)


def stats_ms(values_s: list[float]) -> dict:
    """mean and p50 / p90 / p99 in milliseconds (numpy's linear interpolation); None when empty."""
    if not values_s:
        return {k: None for k in STAT_KEYS}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p = np.percentile(a, PERCENTILES)
    return {"mean": float(a.mean()), **{f"p{q}": float(v) for q, v in zip(PERCENTILES, p)}}


def _content(obj: dict) -> str:
    text = []
    for ch in obj.get("choices") or ():
        if "delta" in ch:
            d = ch["delta"] or {}
            text.append(d.get("content") or "")
            text.append(d.get("reasoning_content") or "")
        else:
            text.append(ch.get("text") or "")
    return "".join(text)


async def send_one(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> RequestRecord:
    """Stream one request; every failure becomes a record with ``ok`` false."""
    rec = RequestRecord(start_s=time.perf_counter() - t0)
    sent = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {raw[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return rec
                now = time.perf_counter() - sent
                text = _content(obj)
                if text:
                    if rec.ttft_s is None:
                        rec.ttft_s = now
                    rec.chunk_times.append(now)
                    rec.text += text
                    chunks += 1
                usage = obj.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    rec.tokens_from_usage = True
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
        rec.e2e_s = time.perf_counter() - sent
        if not rec.tokens_from_usage:
            rec.output_tokens = chunks
        rec.ok = rec.output_tokens > 0 or chunks > 0
        if not rec.ok:
            rec.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        rec.e2e_s = time.perf_counter() - sent
    return rec


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(api_root(base_url) + "/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}: /v1/models lists no model")
    return data[0]["id"]


async def run_benchmark_async(config: BenchConfig, requests: list[BenchRequest]) -> dict:
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits) as client:
        model = config.model or await resolve_model(client, config.base_url)
        path = "/chat/completions" if config.endpoint == "chat" else "/completions"
        url = api_root(config.base_url) + path
        bodies = [r.body(model, config.endpoint, config.ignore_eos, config.temperature, config.extra_body)
                  for r in requests]
        arrivals = poisson_arrivals(len(bodies), config.request_rate, config.seed)
        sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        in_flight = 0
        max_in_flight = 0
        bar = _progress(len(bodies), config)

        after = session_links(requests)
        done = [asyncio.Event() for _ in requests]
        answers: list[str | None] = [None] * len(requests)

        async def one(i: int) -> RequestRecord:
            nonlocal in_flight, max_in_flight
            if after[i] is not None:  # the session's previous turn first, then its real answer
                await done[after[i]].wait()
                bodies[i] = _with_session_answers(requests, after, answers, i).body(
                    model, config.endpoint, config.ignore_eos, config.temperature, config.extra_body)
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            rec = None
            try:
                rec = await send_one(client, url, bodies[i], t0)
            finally:
                in_flight -= 1
                answers[i] = rec.text if rec is not None and rec.ok else None
                done[i].set()
                if sem is not None:
                    sem.release()
                if bar is not None:
                    bar.update(1)
            return rec

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(i) for i in range(len(bodies))))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return summarize(config, model, records, duration, max_in_flight)


def session_links(requests: list[BenchRequest]) -> list[int | None]:
    """For each request, the index of its session's previous turn (None: it starts a
    session, or is no turn of one). Turns are sent in order, each after the one before it
    has finished, as a chat client sends them: the next prompt holds the answer."""
    last: dict = {}
    out: list[int | None] = []
    for i, r in enumerate(requests):
        s = r.meta.get("session")
        out.append(last.get(s) if s is not None else None)
        if s is not None:
            last[s] = i
    return out


def _with_session_answers(requests: list[BenchRequest], after: list[int | None], answers: list[str | None],
                          i: int) -> BenchRequest:
    """Request i with the real answers of its session's earlier turns (a failed turn keeps
    its stand-in)."""
    chain = []
    j = after[i]
    while j is not None:
        chain.append(j)
        j = after[j]
    got = [answers[j] for j in reversed(chain)]
    stand_ins = [m["content"] for m in requests[i].messages if m["role"] == "assistant"]
    return requests[i].with_answers([a if a is not None else d for a, d in zip(got, stand_ins)])


def run_benchmark(config: BenchConfig, requests: list[BenchRequest]) -> dict:
    return asyncio.run(run_benchmark_async(config, requests))


def _progress(total: int, config: BenchConfig):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=config.label or config.dataset or "requests", unit="req", leave=False)


def summarize(config: BenchConfig, model: str, records: list[RequestRecord], duration: float,
              max_in_flight: int) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.ttft_s is not None and r.output_tokens > 1]
    result = {
        "schema": SCHEMA,
        "label": config.label,
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model": model,
        "dataset": config.dataset,
        "seed": config.seed,
        "num_requests": len(records),
        "max_concurrency": config.max_concurrency,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "total_tokens_per_s": (out_tokens + in_tokens) / duration if duration > 0 else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "cached_ratio": (sum(cached) / in_tokens) if cached and in_tokens else None,
        "output_tokens_source": {"usage": sum(r.tokens_from_usage for r in ok),
                                 "chunks": sum(not r.tokens_from_usage for r in ok)},
        "max_in_flight": max_in_flight,
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": stats_ms(itl),
        "tpot_ms": stats_ms(tpot),
        "e2e_ms": stats_ms([r.e2e_s for r in ok]),
    }
    if config.keep_requests:
        result["requests"] = [asdict(r) for r in records]
    return result


def format_result(r: dict) -> str:
    """A short human summary of one result."""

    def st(k: str) -> str:
        s = r[k]
        if s["p50"] is None:
            return f"{k[:-3]:5s} n/a"
        return f"{k[:-3]:5s} p50 {s['p50']:8.1f}  p90 {s['p90']:8.1f}  p99 {s['p99']:8.1f} ms"

    lines = [
        f"{r['label'] or r['dataset']}: {r['completed']}/{r['num_requests']} ok in {r['duration_s']:.1f}s "
        f"(concurrency {r['max_concurrency']}, rate {r['request_rate'] or 'inf'})",
        f"  output {r['output_tokens_per_s']:.1f} tok/s, {r['requests_per_s']:.2f} req/s, "
        f"{r['total_output_tokens']} output / {r['total_input_tokens']} prompt tokens, "
        f"cached {r['cached_prompt_tokens'] if r['cached_prompt_tokens'] is not None else 'n/a'}",
        "  " + st("ttft_ms"), "  " + st("itl_ms"), "  " + st("tpot_ms"), "  " + st("e2e_ms"),
    ]
    if r["errors"]:
        lines.append(f"  errors: {r['errors']}")
    return "\n".join(lines)
