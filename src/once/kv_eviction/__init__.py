"""Eviction policies of a KV block cache, one home for the engine and the simulator:
base.py (the `EvictionPolicy` contract, LRU, the prefix-aware base) and policies.py
(leaf-LRU, LFU-DA, hit density, Belady; `eviction_factory` by name). Torch-free."""
