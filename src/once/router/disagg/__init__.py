"""Prefill/decode disaggregation, the router's side: split.py (which requests go through a
prefill replica; shared with the simulator), routing.py (the prefill leg, then the decode).
The engine's side is `once.engine.kv.disagg`, the simulator's `once.sim.disagg`."""
