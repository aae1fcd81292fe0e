"""OpenAI's Responses API (``/v1/responses``) over the chat endpoint's machinery, with
conversations kept on disk (store.py) and streams that a client can resume (stream_hub.py).

models.py (the request) -> items.py (input items and history -> chat messages, tools)
-> request.py (the chat request, the prompt, the cache lease) -> build.py (output items and
typed events from the deltas) -> stream.py (SSE) -> routes.py (POST, GET, DELETE).
"""
