"""The executor: runs tick plans against a runtime (DESIGN §3)."""

from .executor import Executor, Lease
from .pool import ExecutorConfig
from .speculate import SpecConfig

__all__ = ["Executor", "ExecutorConfig", "Lease", "SpecConfig"]
