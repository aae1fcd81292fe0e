"""Past this machine, on paper: 8 and 64 replicas under a multi-tenant shared-prefix
workload, routed prefix-aware (superfluid's own ``Router``) vs round-robin vs least-loaded.

A pure-Python discrete-event simulation. Each replica is a continuous-batching engine
like superfluid's: ticks that admit up to ``max_batch`` lanes, prefill under a token
budget (only the tokens its prefix cache does not hold), and decode one token per
prefilled lane; a finished request publishes its history's pages into the replica's
LRU prefix cache. A tick lasts ``prefill_tokens / prefill_tok_s + step_s(decode_lanes)``.

The per-replica costs are measured on this machine, by ``benchmarks/runtime_step.py``
on the real runtime (SmolLM2-135M-Instruct, the default q4_1 route, 2 threads):
prefill tok/s at 512 tokens, decode tok/s at 1 and at 32 lanes, from which the decode
step time is a line ``step_s(b) = a + c*b``. The router's own cost per request is
measured here, in this process, on the same Router the front door runs.

Workload: ``4 x replicas`` tenants, each with its own system prompt (512-1024 tokens),
picked by Zipf popularity; each conversation has 2-6 turns, a turn's prompt being the
system prompt, every earlier turn (question and answer) and a new question (32-128
tokens); answers 32-96 tokens; a next turn comes 2 s (exponential) after the answer.
Conversations arrive as a Poisson process at ``--load`` of the cluster's no-cache capacity.

    python benchmarks/cluster_sim.py --replicas 8,64 --out benchmarks/results/cluster_sim.json
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from superfluid.cluster.router import Router, RouterConfig, page_hashes  # noqa: E402

POLICIES = ("prefix", "round_robin", "least_loaded")
PAGE = 16


@dataclass(frozen=True)
class Costs:
    prefill_tok_s: float
    step_a: float  # decode step seconds = step_a + step_c * lanes
    step_c: float
    source: str

    def tick_s(self, prefill_tokens: int, decode_lanes: int) -> float:
        t = prefill_tokens / self.prefill_tok_s
        return t + (self.step_a + self.step_c * decode_lanes if decode_lanes else 0.0)


def load_costs(path: Path, variant: str) -> Costs:
    r = json.loads(path.read_text())["results"]
    prefill = r["prefill_512"][variant]["tok_s"]
    t1 = 1.0 / r["decode_1"][variant]["tok_s"]  # one lane: one token per step
    t32 = 32.0 / r["decode_32"][variant]["tok_s"]  # 32 lanes: 32 tokens per step
    c = (t32 - t1) / 31.0
    return Costs(prefill, t1 - c, c, f"{path.relative_to(ROOT)}:{variant}")


# ------------------------------------------------------------------ workload


@dataclass
class Turn:
    conv: int
    prompt: list[int]
    hashes: list[int]
    output_len: int
    arrival: float
    replica: str = ""
    cached: int = 0
    prefill_left: int = 0
    decode_left: int = 0
    first_token: float | None = None


@dataclass
class Conversation:
    history: list[int]
    turns_left: int


class Workload:
    def __init__(self, rng: random.Random, tenants: int):
        self.rng = rng
        self.fresh = itertools.count(10_000_000)  # token ids nobody shares
        self.systems = [self._tokens(rng.randint(512, 1024)) for _ in range(tenants)]
        weights = [1.0 / (k + 1) ** 0.9 for k in range(tenants)]  # Zipf popularity
        self.cum = list(itertools.accumulate(weights))

    def _tokens(self, n: int) -> list[int]:
        return [next(self.fresh) for _ in range(n)]

    def conversation(self) -> Conversation:
        k = self.rng.random() * self.cum[-1]
        tenant = next(i for i, c in enumerate(self.cum) if c >= k)
        return Conversation(list(self.systems[tenant]), self.rng.randint(2, 6))

    def turn(self, conv_id: int, conv: Conversation, now: float) -> Turn:
        prompt = conv.history + self._tokens(self.rng.randint(32, 128))
        return Turn(conv_id, prompt, page_hashes(prompt, PAGE, 1 << 30), self.rng.randint(32, 96), now)


# ------------------------------------------------------------------ one replica


class Replica:
    def __init__(self, name: str, costs: Costs, cache_tokens: int, max_batch: int, budget: int):
        self.name = name
        self.costs = costs
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.cache_pages = cache_tokens // PAGE
        self.max_batch = max_batch
        self.budget = budget
        self.waiting: collections.deque[Turn] = collections.deque()
        self.running: list[Turn] = []
        self.busy = False

    def cached_prefix(self, t: Turn) -> int:
        n = 0
        for h in t.hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            n += 1
        return n * PAGE

    def publish(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_pages:
            self.cache.popitem(last=False)

    def start_tick(self) -> tuple[float, list[tuple[Turn, int]]] | None:
        while self.waiting and len(self.running) < self.max_batch:
            t = self.waiting.popleft()
            t.cached = min(self.cached_prefix(t), len(t.prompt) - 1)
            t.prefill_left = len(t.prompt) - t.cached
            t.decode_left = t.output_len
            self.running.append(t)
        if not self.running:
            return None
        budget, chunks = self.budget, []
        for t in self.running:
            if t.prefill_left and budget:
                take = min(t.prefill_left, budget)
                chunks.append((t, take))
                budget -= take
        decoding = sum(1 for t in self.running if not t.prefill_left)
        return self.costs.tick_s(self.budget - budget, decoding), chunks

    def end_tick(self, now: float, chunks: list[tuple[Turn, int]]) -> list[Turn]:
        for t, take in chunks:
            t.prefill_left -= take
        done = []
        for t in self.running:
            if t.prefill_left:
                continue
            if t.first_token is None:
                t.first_token = now  # sampled in the tick that ends its prefill, as the engine does
            t.decode_left -= 1
            if t.decode_left <= 0:
                done.append(t)
        self.running = [t for t in self.running if t not in done]
        return done


# ------------------------------------------------------------------ the simulation


def simulate(n_replicas: int, policy: str, costs: Costs, args, seed: int) -> dict:
    rng = random.Random(seed)
    work = Workload(rng, tenants=4 * n_replicas)
    names = [f"r{i}" for i in range(n_replicas)]
    replicas = {n: Replica(n, costs, args.cache_tokens, args.max_batch, args.prefill_budget) for n in names}
    router = Router(RouterConfig(page=PAGE, max_pages=256), policy=policy)
    for n in names:
        router.add(n)
    # no-cache capacity: one turn costs its prefill (~1,100 tokens mean) plus its share of decode
    per_turn_s = 1100 / costs.prefill_tok_s + 64 * costs.tick_s(0, 16) / 16
    conv_rate = args.load * n_replicas / per_turn_s / 4.0  # 4 turns per conversation on average
    events: list = []
    seq = itertools.count()
    convs: dict[int, Conversation] = {}
    finished: list[Turn] = []
    route_s = 0.0
    t = 0.0
    while t < args.duration:
        t += rng.expovariate(conv_rate)
        heapq.heappush(events, (t, next(seq), "conv", None))

    def kick(r: Replica, now: float) -> None:
        if r.busy:
            return
        got = r.start_tick()
        if got is not None:
            r.busy = True
            heapq.heappush(events, (now + got[0], next(seq), "tick", (r, got[1])))

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "conv":
            cid = next(seq)
            convs[cid] = work.conversation()
            kind, data = "turn", cid
        if kind == "turn":
            conv = convs[data]
            turn = work.turn(data, conv, now)
            t0 = time.perf_counter()
            route = router.route(turn.prompt)
            router.placed(route.replica, turn.prompt)
            route_s += time.perf_counter() - t0
            turn.replica = route.replica
            r = replicas[route.replica]
            r.waiting.append(turn)
            kick(r, now)
        elif kind == "tick":
            r, chunks = data
            r.busy = False
            for done in r.end_tick(now, chunks):
                finished.append(done)
                conv = convs[done.conv]
                answer = work._tokens(done.output_len)
                conv.history = done.prompt + answer
                r.publish(page_hashes(conv.history, PAGE, 1 << 30))
                router.left(r.name)
                router.remember(r.name, conv.history)
                conv.turns_left -= 1
                if conv.turns_left > 0 and now < args.duration:
                    heapq.heappush(events, (now + rng.expovariate(1 / args.think_s), next(seq), "turn", done.conv))
            kick(r, now)
    measured = [f for f in finished if f.arrival >= args.warmup]
    ttft = sorted(f.first_token - f.arrival for f in measured)
    prompt_tokens = sum(len(f.prompt) for f in measured)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    per_replica = collections.Counter(f.replica for f in measured)
    return {
        "replicas": n_replicas, "policy": policy, "requests": len(measured),
        "prefix_hit_rate": sum(f.cached for f in measured) / prompt_tokens,
        "ttft_p50_s": pct(0.50), "ttft_p99_s": pct(0.99), "ttft_mean_s": sum(ttft) / len(ttft),
        "requests_per_replica_max_over_mean": max(per_replica.values()) / (len(measured) / n_replicas),
        "router_us_per_request": 1e6 * route_s / max(1, len(finished)),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.25
    for k, policy in enumerate(POLICIES):
        got = {r["replicas"]: r for r in rows if r["policy"] == policy}
        xs = [i + (k - 1) * width for i in range(len(sizes))]
        axes[0].bar(xs, [100 * got[s]["prefix_hit_rate"] for s in sizes], width, label=policy)
        axes[1].bar(xs, [got[s]["ttft_p50_s"] for s in sizes], width, label=policy)
        axes[2].bar(xs, [got[s]["ttft_p99_s"] for s in sizes], width, label=policy)
    for ax, title in zip(axes, ("prefix-cache hit rate (% of prompt tokens)", "p50 TTFT (s)", "p99 TTFT (s)")):
        ax.set_xticks(range(len(sizes)), [f"{s} replicas" for s in sizes])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("simulated replicas, multi-tenant shared prefixes (costs: this machine, SmolLM2 q4_1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(rows: list[dict]) -> str:
    lines = ["| replicas | routing | requests | prefix hit rate | TTFT p50 s | TTFT p99 s | max/mean requests per replica |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['policy']} | {r['requests']} | {100 * r['prefix_hit_rate']:.1f}% | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['requests_per_replica_max_over_mean']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="8,64")
    ap.add_argument("--costs", default=str(ROOT / "benchmarks/results/runtime_step_quant.json"))
    ap.add_argument("--variant", default="ours_q4_1", help="the runtime_step variant whose costs a replica has")
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    ap.add_argument("--warmup", type=float, default=120.0, help="turns arriving before this are not measured")
    ap.add_argument("--load", type=float, default=0.7, help="offered load, as a share of no-cache capacity")
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--cache-tokens", type=int, default=32768, help="each replica's prefix cache")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cluster_sim.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out's JSON")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text())["results"], Path(args.out).with_suffix(".png"))
        return 0
    costs = load_costs(Path(args.costs), args.variant)
    rows = []
    for n in [int(x) for x in args.replicas.split(",")]:
        for policy in POLICIES:
            t0 = time.perf_counter()
            row = simulate(n, policy, costs, args, args.seed)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")}
    out.write_text(json.dumps({"benchmark": "cluster_sim", "costs": costs.__dict__, "config": config,
                               "results": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
