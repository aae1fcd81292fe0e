"""The engine: requests, scheduling over the tick contract, and text. ``LLM``, the Python
API over it, is one layer up (superfluid/entrypoints/llm.py).

    request.py, params.py     what a generation is and what it asks for (errors.py: ParamError)
    handles.py                a request's executor handles, acquired once and released once
    lifecycle.py              a request's phases and the moves allowed between them
    request_table.py          the requests (waiting, running, orphaned lanes); the one place phases change
    planner.py, scheduler.py  requests -> TickPlans; the scheduler composes table, planner, leases, finisher
    token_events.py           the one door tokens come by (TokenEvent); finisher.py: where requests end
    updates.py                the scheduler's stats and errors
    detokenizer.py, stop.py   text from token bytes; stop strings across tokens
    choice.py, outputs.py     one choice's text state; vLLM-shaped outputs and deltas
    engine.py                 the synchronous engine (one thread owns the executor)
    async_engine.py           a loop thread behind asyncio: the server's engine
    loader.py                 building an engine
"""
