"""The server sees an engine only as a ``ServingEngine`` (engine/serving.py), and both
engines it serves (``AsyncEngine``, the cluster's ``ClusterEngine``) are one. Fast: the
toy runtime, and a front door with no replica (no Ray)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from superfluid.cluster.frontdoor import ClusterEngine
from superfluid.cluster.router import Router, RouterConfig
from superfluid.engine.async_engine import AsyncEngine
from superfluid.engine.config import EngineConfig
from superfluid.engine.loader import build_engine
from superfluid.engine.serving import ServingEngine

SERVER = Path(__file__).resolve().parent.parent / "superfluid" / "server"
MEMBERS = {n for n in vars(ServingEngine) if not n.startswith("_")} | set(ServingEngine.__annotations__)


@pytest.fixture(scope="module")
def async_engine():
    eng = AsyncEngine(build_engine(EngineConfig(runtime="toy")))
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def cluster_engine(async_engine):
    e = async_engine
    return ClusterEngine([], Router(RouterConfig()), tokenizer=e.tokenizer, desc=e.desc, config=e.config,
                         model_name=e.model_name)


def test_the_protocol_names_what_the_server_uses():
    assert MEMBERS == {"tokenizer", "model_name", "desc", "config", "observer", "max_seq_len", "vocab_size",
                       "figures", "alive", "pid", "validate", "worker_health", "start", "stop", "submit"}


@pytest.mark.parametrize("which", ["async_engine", "cluster_engine"])
def test_both_engines_are_serving_engines(which, request):
    eng = request.getfixturevalue(which)
    assert isinstance(eng, ServingEngine)
    missing = [m for m in sorted(MEMBERS) if not hasattr(eng, m)]
    assert missing == []


def test_the_figures_are_what_metrics_reads(async_engine, cluster_engine):
    f = async_engine.figures
    assert (f.num_waiting, f.num_running, f.stats.ticks) == (0, 0, 0)
    assert cluster_engine.figures is None  # a front door's figures are its replicas'


def test_the_door_checks_a_request_as_a_replica_would(async_engine, cluster_engine):
    from superfluid.engine.params import ParamError, SamplingParams

    for eng in (async_engine, cluster_engine):
        eng.validate([1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(ParamError):
            eng.validate([eng.vocab_size], SamplingParams(max_tokens=4))


def _engine_reads(tree: ast.AST) -> set[str]:
    """Attributes read off anything named ``engine`` (``engine.x``, ``self.engine.x``,
    ``serving.engine.x``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "engine") or (isinstance(v, ast.Attribute) and v.attr == "engine"):
                out.add(node.attr)
    return out


def test_the_walker_sees_a_reach_in():
    assert _engine_reads(ast.parse("core = self.engine.engine\nengine.engine.scheduler.stats")) == {"engine", "scheduler"}


def test_the_server_reads_only_protocol_members():
    used, imports = set(), []
    for path in SERVER.rglob("*.py"):
        tree = ast.parse(path.read_text())
        used |= _engine_reads(tree)
        imports += [f"{path.name}: {n.module}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and (n.module or "").endswith(("async_engine", "engine.engine", "scheduler", "cluster"))]
    assert used - MEMBERS == set()
    assert imports == []  # no engine class, no scheduler, no front door: the protocol only


def test_the_cluster_door_refuses_a_priority_under_fcfs_as_a_replica_would():
    """Regression: ClusterEngine.validate borrowed Engine.validate, whose priority check
    read a scheduler the door does not have (an AttributeError for any priority)."""
    import pytest

    from superfluid.cluster.frontdoor import ClusterEngine
    from superfluid.engine.config import EngineConfig, SchedulerConfig
    from superfluid.engine.params import ParamError, SamplingParams
    from superfluid.runtimes.toy import ToyRuntime

    rt = ToyRuntime()
    fcfs = EngineConfig(runtime="toy", scheduler=SchedulerConfig(scheduling_policy="fcfs"))
    door = ClusterEngine([], None, tokenizer=rt.tokenizer, desc=rt.desc, config=fcfs, model_name="toy")
    with pytest.raises(ParamError, match="priority scheduling is not enabled"):
        door.validate([1, 2, 3], SamplingParams(priority=3))
    door.config = EngineConfig(runtime="toy")  # the default policy: priority
    door.validate([1, 2, 3], SamplingParams(priority=3))  # allowed: the replicas schedule by it
