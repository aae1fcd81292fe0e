"""Benchmarks: a serving load generator for OpenAI-compatible servers (``serve``),
offline throughput against transformers (``offline``) and their datasets (``datasets``).
"""
