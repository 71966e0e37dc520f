"""The router layer: picks a replica per request (see router.py and DESIGN.md)."""

from once.router.index import ApproximatePrefixIndex, ExactPrefixIndex
from once.router.openai_replica import OpenAICompletionsClient
from once.router.policies import POLICIES, ReplicaView, RequestView, make_policy
from once.router.replicas import Replica
from once.router.router import Router, RouterConfig

__all__ = [
    "POLICIES",
    "ApproximatePrefixIndex",
    "ExactPrefixIndex",
    "OpenAICompletionsClient",
    "Replica",
    "ReplicaView",
    "RequestView",
    "Router",
    "RouterConfig",
    "make_policy",
]
