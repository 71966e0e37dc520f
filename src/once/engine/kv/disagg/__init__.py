"""Prefill/decode disaggregation, the engine's side: transfer.py (a prefill engine's
transfer store, shm or TCP, as its lowest tier), peers.py (a decode engine's readers of
prefill engines' stores), role.py (what a role changes about a request on its way in and
out). The router's side is `once.router.disagg` (split.py: which requests go through a
prefill replica; routing.py: the prefill leg), the simulator's `once.sim.disagg`
(transfer.py: the pools and the link; compare.py: `once sim --pd`)."""
