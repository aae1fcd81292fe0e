"""Replicas of the engine on Ray behind one front door (``superfluid serve --replicas N``,
``LLM(replicas=N)``).

- ``hashring``: consistent hashing with bounded load.
- ``router``: which replica a request goes to (prompt_cache_key, leading prompt pages,
  else the least loaded), with the counters /metrics shows.
- ``replica``: the Ray actor that owns one engine (its supervised worker and runtime).
- ``handover``: a draining replica's running requests, exported for another to adopt.
- ``frontdoor``: the ``ServingEngine`` the OpenAI app serves from; it re-admits
  a lost replica's requests elsewhere (decode replay, same rng base) and moves a
  drained replica's requests by export/adopt.
- ``launch``: Ray start-up and actor placement; ``offline``: ``LLM(replicas=N)``.

Ray is an optional extra (``pip install -e .[ray]``); nothing here is imported by a
single-engine ``serve``.
"""
