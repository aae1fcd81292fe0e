"""schemathesis hooks for tests/test_fuzz_api.py: every generated body names the served
model, so the fuzzer reaches validation and generation instead of the 404 for an unknown
model (which it still meets through the coverage phase's own values)."""

import schemathesis


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict) and "model" in body:
        body["model"] = "toy"
    return body
