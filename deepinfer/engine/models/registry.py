"""Maps config.json `architectures` names to model classes."""

from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.deepseek_v3 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from deepinfer.engine.models.layers import DecoderForCausalLM
from deepinfer.engine.models.llama import LlamaForCausalLM
from deepinfer.engine.models.qwen2 import Qwen2ForCausalLM
from deepinfer.engine.models.qwen3 import Qwen3ForCausalLM
from deepinfer.engine.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from deepinfer.errors import UnsupportedArchitectureError

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def build_model(cfg: ModelConfig) -> DecoderForCausalLM:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        )
    return cls(cfg)
