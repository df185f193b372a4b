"""Decode pool: KV admission per arriving chunk, continuous-batching paged decode."""
