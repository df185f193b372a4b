"""Prefill pool: chunked prefill with fairness and chunk policies, KV streamed per chunk."""
