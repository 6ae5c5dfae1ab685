"""Model loading: HF directories, GGUF files (converted and cached), and the default model."""

from deepinfer.engine.loader.model_loader import LoadedModel, default_model_path, load_model

__all__ = ["LoadedModel", "default_model_path", "load_model"]
