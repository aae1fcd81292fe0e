"""``superfluid serve | generate | chat``."""

from __future__ import annotations

import argparse
import itertools
import sys

from .engine.config import EngineConfig, SchedulerConfig
from .models import DEFAULT_MODEL
from .server.toolcalls.registry import PARSERS as TOOL_PARSERS


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"a registered name, a .gguf file or a Hugging Face folder (default: {DEFAULT_MODEL})")
    p.add_argument("--runtime", default="auto", choices=["auto", "torch", "toy", "llamacpp"],
                   help="the model runtime (default auto: torch where it runs the file's architecture and tensor "
                        "types, else llamacpp: any GGUF llama.cpp loads, via llama-cpp-python)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the runtime's choice)")
    p.add_argument("--quant", default="auto", choices=["auto", "gguf", "none", "q8_0", "q4_1"],
                   help="auto (default) = gguf on a GGUF file on CPU: every matrix on the native kernel for its own "
                        "blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; F16/F32 -> q8_0, Q2_K/Q3_K -> q4_1), "
                        "batch-invariant; none: the fp32 reference numerics that match transformers; q8_0|q4_1: every "
                        "matrix requantized to that kernel")
    p.add_argument("--kv-cache-mb", type=int, default=0, help="KV cache pool size in MiB (default: the runtime's)")
    p.add_argument("--max-batch", type=int, default=0, help="most sequences per forward step (default: the runtime's)")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics: the same text at any load")
    p.add_argument("--prefill-budget", type=int, default=512, help="prompt tokens prefilled per tick, over all requests")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV of earlier prompts")
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                   help="prompt-lookup speculative decoding, on by default (a measured gate switches it off where it "
                        "does not pay); --no-speculative: never draft")
    p.add_argument("--cache-protected-fraction", type=float, default=0.25,
                   help="share of the KV pool that prompt_cache_key entries hold against eviction (default 0.25)")
    p.add_argument("--host-cache-mb", type=int, default=64,
                   help="host memory for prefix-cache entries exported out of the pool (24h retention first; default 64)")
    p.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"],
                   help="priority (default): a request's priority (lower first, FCFS among equals) orders the queue, and a "
                        "better one preempts the worst running request when the batch or the KV cache is full; "
                        "fcfs: arrival order, a request that names a priority is refused")
    p.add_argument("--priority-aging", type=float, default=0.0, metavar="S",
                   help="every S seconds a request has waited or run counts as one priority level better (0: off)")


def _config(args: argparse.Namespace, **extra) -> EngineConfig:
    progress = extra.pop("progress", False) or sys.stderr.isatty()  # a tqdm bar while weights load
    return EngineConfig(
        model=args.model or ("toy" if args.runtime == "toy" else DEFAULT_MODEL),
        runtime=args.runtime,
        dtype=args.dtype,
        quant=args.quant,
        kv_cache_mb=args.kv_cache_mb,
        max_batch=args.max_batch,
        deterministic=args.deterministic,
        progress=progress,
        host_cache_mb=args.host_cache_mb,
        scheduler=SchedulerConfig(
            cache_protected_fraction=args.cache_protected_fraction,
            prefill_token_budget=args.prefill_budget,
            prefix_caching=not args.no_prefix_cache,
            determinism_class=1 if args.deterministic else 0,
            speculative=args.speculative,
            scheduling_policy=args.scheduling_policy,
            priority_aging_s=args.priority_aging,
        ),
        **extra,
    )


def _build(config: EngineConfig):
    from .engine.loader import build_engine, resolve_runtime

    config = resolve_runtime(config)
    why = f" ({config.runtime_reason})" if config.runtime_reason else ""
    print(f"superfluid: loading {config.model} on the {config.runtime} runtime{why} ...", file=sys.stderr, flush=True)
    return build_engine(config)


# ------------------------------------------------------------------ serve


def _runtime_extra(items: list[str] | None) -> tuple[tuple[str, object], ...]:
    """``KEY=VALUE`` pairs, each VALUE as JSON when it parses (numbers, booleans), else a string."""
    import json

    out = []
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--runtime-arg expects KEY=VALUE, got {item!r}")
        try:
            out.append((key, json.loads(value)))
        except json.JSONDecodeError:
            out.append((key, value))
    return tuple(out)


def _exit_0(signum, frame) -> None:
    raise SystemExit(0)


def serve(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    # SIGTERM is a normal stop: exit 0. While serving, uvicorn handles it (drains) and
    # raises it again once done, which lands here instead of killing the process.
    signal.signal(signal.SIGTERM, _exit_0)

    from .engine.async_engine import AsyncEngine
    from .server.auth import api_key
    from .server.http_config import uvicorn_config
    from .server.limits import limits_from_args
    from .server.openai import create_app
    from .server.state_args import app_kwargs

    args.resolved_api_key = api_key(args.api_key)

    config = _config(
        args, max_queued_requests=args.max_queued_requests, max_n=args.max_n, progress=True, worker=not args.in_process,
        max_request_tokens=args.max_request_tokens,
        worker_stall_timeout=args.worker_stall_timeout, runtime_extra=_runtime_extra(args.runtime_arg),
    )
    if args.replicas:  # several replicas on Ray behind this one door (optional extra: .[ray])
        from .cluster.serve import serve_cluster

        return serve_cluster(args, config)
    engine = _build(config)
    async_engine = AsyncEngine(engine, max_queued=config.max_queued_requests)
    app = create_app(async_engine, model_name=args.served_model_name or config.model, drain_s=args.drain_timeout,
                     limits=limits_from_args(args), request_timeout=args.request_timeout, api_key=args.resolved_api_key,
                     web_ui=not args.no_web_ui, **app_kwargs(args))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Drain from the signal on, while uvicorn stops accepting and waits for the
            # open responses: each ends properly (finished, or an error at the deadline)
            # before uvicorn's own timeout would cut its connection.
            async_engine.begin_drain(args.drain_timeout)
            super().handle_exit(sig, frame)

    print(f"superfluid: serving {args.served_model_name or config.model} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    Server(uvicorn_config(app, args)).run()
    return 0


# ------------------------------------------------------------------ generate / chat


def _params(args: argparse.Namespace):
    from .engine.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )


def _stream(engine, rid: str, ids: list[int], params) -> str:
    """Run one request to its end, printing text as it comes; returns the text."""
    out: list[str] = []

    def show(d) -> None:
        if d.request_id == rid and d.text:
            out.append(d.text)
            print(d.text, end="", flush=True)

    engine.stream_to(show)
    try:
        engine.add_request(rid, ids, params)
        while engine.has_work():
            engine.step()
    finally:
        engine.stream_to(None)
    print(flush=True)
    return "".join(out)


def generate(args: argparse.Namespace) -> int:
    from .engine.params import ParamError

    engine = _build(_config(args))
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        text = args.prompt
    try:
        _stream(engine, "generate", tok.encode(text, add_special_tokens=False), _params(args))
    except ParamError as e:
        print(f"superfluid: {e}", file=sys.stderr)
        return 2
    return 0


def chat(args: argparse.Namespace) -> int:
    engine = _build(_config(args))
    tok = engine.tokenizer
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("superfluid chat: an empty line or Ctrl-D ends.", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        reply = _stream(engine, f"chat-{turn}", tok.encode(text, add_special_tokens=False), _params(args))
        messages.append({"role": "assistant", "content": reply})
    return 0


# ------------------------------------------------------------------ main


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")


def _exposure_args(s: argparse.ArgumentParser) -> None:
    """What bounds a server's exposure and its slow clients (server/http_config.py, auth.py)."""
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SUPERFLUID_API_KEY; none: open)")
    s.add_argument("--stream-idle-timeout", type=float, default=60.0, metavar="S",
                   help="a streaming client that reads nothing for this long is cut off and its request aborted")
    s.add_argument("--limit-concurrency", type=int, default=2048,
                   help="open connections (or running requests) past which a new request gets 503")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a connection whose request headers are not complete this long after it opened is closed")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body not received in full within this many seconds gets 408")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="superfluid", description="An LLM inference engine and OpenAI-compatible server.")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests beyond which new ones get 429")
    s.add_argument("--max-n", type=int, default=16, help="the largest n a request may ask for")
    s.add_argument("--max-body-mb", type=float, default=8.0, help="request bodies larger than this get 413")
    s.add_argument("--max-prompt-chars", type=int, default=0,
                   help="prompt text longer than this is refused before tokenising (default: 32 per context token)")
    s.add_argument("--request-timeout", type=float, default=0.0,
                   help="a request still running after this many seconds ends with an error (0: no deadline; "
                        "a request may ask for less with its `timeout` field)")
    s.add_argument("--max-request-tokens", type=int, default=1 << 17, help="the most n x max_tokens a request may ask for")
    _exposure_args(s)
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_PARSERS],
                   help="how the model writes tool calls (default auto: read from its chat template)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent with a chat request (vLLM's flag; without it such a request is a 400)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--drain-timeout", type=float, default=5.0, help="seconds running requests get to finish on SIGTERM")
    s.add_argument("--no-web-ui", action="store_true", help="do not serve the chat page at / (the API is the same)")
    s.add_argument("--in-process", action="store_true", help="run the model in the server's process, not a supervised worker")
    s.add_argument("--runtime-arg", action="append", metavar="KEY=VALUE",
                   help="an extra keyword argument for the runtime (repeatable; tests: step_delay=0.02 slows the toy)")
    s.add_argument("--worker-stall-timeout", type=float, default=60.0,
                   help="seconds a running tick may go without a completed runtime call before the worker is replaced")
    s.add_argument("--replicas", type=int, default=0,
                   help="serve N engine replicas placed by Ray behind this endpoint (prefix-aware routing, "
                        "failover); needs the ray extra. Default: one engine, no Ray")
    s.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    s.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica holds")
    s.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs each replica holds")
    from .server.state_args import add_args  # --state-dir, the responses store's and the streams' bounds

    add_args(s)
    s.set_defaults(func=serve)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _engine_args(g)
    _sampling_args(g, 128)
    g.set_defaults(func=generate)

    c = sub.add_parser("chat", help="an interactive chat in the terminal")
    c.add_argument("--system", default=None, help="a system message")
    _engine_args(c)
    _sampling_args(c, 512)
    c.set_defaults(func=chat)

    from .bench.cli import add_parsers  # superfluid bench serve | offline | dataset

    add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a model that does not load, a bad option value
        from .models import ModelLoadError
        from .worker.client import WorkerFailed

        if isinstance(e, (ModelLoadError, ValueError, WorkerFailed)):
            print(f"superfluid: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
