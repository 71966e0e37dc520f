"""once: an agent-serving stack that never pays twice for the same work."""

import os

__version__ = "0.1.0"

# OpenMP threads that sleep as soon as they wait, so that a busy machine's cores are shared
# rather than spun on (once/cpus.py has the measurement). OpenMP reads these when torch
# loads it, so they are set here, before any module of once can import torch; whoever set
# any of OPENMP_WAIT_VARS chose already. Here and not in once.cpus: importing once.protocol
# must load no other module of once (tests/test_torch_free.py).
OPENMP_WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def yield_waiting_threads(environ=os.environ) -> None:
    if not any(name in environ for name in OPENMP_WAIT_VARS):
        environ.update(OPENMP_WAIT_POLICY)


yield_waiting_threads()
