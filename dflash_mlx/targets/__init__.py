"""Target models: mlx-lm decoders run with hidden-state taps and exact cache rollback."""

from .adapter import (TargetModel, build_target, model_type_of, register_target_class, split_into_stages,
                      target_class)
from .families import supported_model_types

__all__ = ["TargetModel", "build_target", "model_type_of", "register_target_class", "split_into_stages",
           "supported_model_types", "target_class"]
