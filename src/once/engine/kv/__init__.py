"""Paged KV cache: blocks, the prefix-cache manager, connectors and the event publisher.

Block hashing and the KV event types are the contract engines share with the router and
the simulator: `once.protocol.kv_blocks`.
"""
