"""The OpenAI-compatible HTTP server: protocol.py (requests), openai.py (the app),
render.py (response bodies), errors.py (OpenAI's error shape), metrics.py (Prometheus)."""
