"""The executor: runs tick plans against a runtime (DESIGN §3).

    interface.py        the one executor interface (Executor here, WorkerClient over a socket)
    executor.py         the operations between ticks; the state lives in a TickContext
    context.py          what a tick works on: lanes, the cache pool, leases, handles, pace
    tick.py             one tick: validate.py and capacity.py (no change), then the carry-out:
                        retire.py, admit.py, prefill.py, decode.py (rows.py, verify.py, replay.py)
    tick_state.py, faults.py   what a carry-out accumulates; lane faults and the fatal path
    cache.py, pool.py, leases.py   the prefix cache, its pool policy, leases on its entries
    sampling.py, grammar.py, speculate.py   row processing, grammars, prompt-lookup drafts
"""

from .executor import Executor
from .pool import ExecutorConfig
from .speculate import SpecConfig

__all__ = ["Executor", "ExecutorConfig", "SpecConfig"]
