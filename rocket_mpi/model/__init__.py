"""The model families: each module implements one (load, new_cache, forward, forward_static) on shared layers."""
from __future__ import annotations

from rocket_mpi.errors import ConfigError
from rocket_mpi.model.glm4_moe import Glm4MoeModel
from rocket_mpi.model.glm5_next import Glm5NextModel
from rocket_mpi.model.glm_moe_dsa import DeepseekV3Model, GlmMoeDsaModel

MODELS = {"glm4_moe": Glm4MoeModel, "glm_moe_dsa": GlmMoeDsaModel, "glm5_next": Glm5NextModel,
          "glm5_next_text": Glm5NextModel, "deepseek_v3": DeepseekV3Model}


def model_class(model_type: str):
    """The class implementing a model family (config.json's model_type)."""
    cls = MODELS.get(model_type)
    if cls is None:
        raise ConfigError(f"model_type '{model_type}' is not supported (supported: {', '.join(MODELS)})")
    return cls
