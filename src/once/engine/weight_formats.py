"""The matmul weight formats by name (EngineConfig.weights), for whoever builds a model.

A format is an `ops.WeightFormat`: it turns each fp32 weight into a layer that applies
itself (ops.py, the seam). This module only maps the config's names onto them, so the
model, the engine and the draft model never compare format names themselves.
"""

from once.engine.config import WEIGHT_FORMATS
from once.engine.ops import Fp32Weights, WeightFormat
from once.engine.quant_q8_0 import Q8_0Weights


def weight_format(name: str, pack: bool = True) -> WeightFormat:
    """The format called `name`. pack: fp32 weights keep a oneDNN-packed copy (the
    fallback of Q8_0 for weights it cannot hold, too)."""
    if name == "fp32":
        return Fp32Weights(pack)
    if name == "q8_0":
        return Q8_0Weights(fallback=Fp32Weights(pack))
    raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {name!r}")
