"""Paged KV cache: blocks, hashing, events, connectors."""
