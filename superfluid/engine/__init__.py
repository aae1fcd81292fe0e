"""The engine: requests, scheduling over the tick contract, and text. ``LLM``, the Python
API over it, is one layer up (superfluid/entrypoints/llm.py).

    request.py, params.py     what a generation is and what it asks for (errors.py: ParamError)
    handles.py                a request's executor handles, acquired once and released once
    planner.py, scheduler.py  requests -> TickPlans; tick_events.py: TickEvents -> request progress
    updates.py                what a step reports (RequestUpdate, stats, errors)
    detokenizer.py, stop.py   text from token bytes; stop strings across tokens
    choice.py, outputs.py     one choice's text state; vLLM-shaped outputs and deltas
    engine.py                 the synchronous engine (one thread owns the executor)
    async_engine.py           a loop thread behind asyncio: the server's engine
    loader.py                 building an engine
"""
