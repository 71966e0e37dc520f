"""The scripted engine is a protocol-level fake: once.protocol.scripted_engine.

Kept so that code written against this path still imports it.
"""

from once.protocol.scripted_engine import ScriptedEngine, scripted_logprobs

__all__ = ["ScriptedEngine", "scripted_logprobs"]
