"""Target models: mlx-lm decoders run with hidden-state taps and exact cache rollback."""

from .adapter import TargetModel, model_type_of
from .families import supported_model_types

__all__ = ["TargetModel", "model_type_of", "supported_model_types"]
