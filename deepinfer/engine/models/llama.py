"""Llama (and SmolLM2, which is one): the plain pre-norm decoder with GQA and rotate-half rope."""

from deepinfer.engine.models.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """No quirks: q/k/v without bias, no q/k norm; rope scaling from the config."""
