"""What users call, above every other layer: the offline ``LLM`` API (llm.py).

The command line (``superfluid/cli.py``), ``superfluid bench`` and the package root sit in
this layer too; nothing below imports from here (tests/test_structure.py enforces it).
"""
