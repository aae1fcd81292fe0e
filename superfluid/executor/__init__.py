"""The executor: runs tick plans against a runtime (DESIGN §3)."""

from .executor import Executor, ExecutorConfig, SeedLease
from .speculate import SpecConfig

__all__ = ["Executor", "ExecutorConfig", "SeedLease", "SpecConfig"]
