"""Prefill/decode disaggregation in the simulator: transfer.py (the prefill and decode
pools and the link between them), compare.py (`once sim --pd`: disaggregated against
colocated). The split policy is the router's (`once.router.disagg.split`); the engine's
side is `once.engine.kv.disagg`."""
