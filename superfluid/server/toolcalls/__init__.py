"""Tool calls out of generated text, one parser per model family (registry.py).

Every parser is incremental: it keeps a cursor and the state of what it is reading, so
the work of a push is proportional to the new text (amortised), never to the whole
response. scan.py has the pieces they share; tool_parser.py (one level up) turns what
they find into OpenAI's deltas.
"""
