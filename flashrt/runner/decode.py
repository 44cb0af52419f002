"""The AR decode runner, re-exported: it lives in `flashrt.runtime.decode` (model-agnostic graph
machinery that frontends may compose, e.g. Pi0-FAST's action-token decode, without importing a
runner). Existing imports from here keep working."""

from flashrt.runtime.decode import (
    DEFAULT_BUCKETS,
    MODES,
    DecodeIO,
    DecodeModel,
    Decoder,
    Generation,
    Sampling,
)

__all__ = ["DecodeModel", "DecodeIO", "Sampling", "Decoder", "Generation", "DEFAULT_BUCKETS", "MODES"]
