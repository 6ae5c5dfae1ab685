"""Tiny random-weight Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 models saved as Hugging Face directories."""

from __future__ import annotations

import pathlib

import torch

from model_factory import make_tokenizer_files

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def moe_config(arch: str, vocab: int, **over):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3_moe":
        kw = dict(common, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=10000.0)
        kw.update(over)
        return transformers.Qwen3MoeConfig(**kw), transformers.Qwen3MoeForCausalLM
    if arch == "qwen2_moe":
        kw = dict(common, num_hidden_layers=4, num_key_value_heads=2, num_experts=6, norm_topk_prob=False,
                  decoder_sparse_step=2, mlp_only_layers=[], shared_expert_intermediate_size=48, rope_theta=10000.0)
        kw.update(over)
        return transformers.Qwen2MoeConfig(**kw), transformers.Qwen2MoeForCausalLM
    if arch == "deepseek_v3":
        kw = dict(common, num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
                  n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                  rope_interleave=True,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0,
                                       beta_fast=32, beta_slow=1))
        kw.update(over)
        return transformers.DeepseekV3Config(**kw), transformers.DeepseekV3ForCausalLM
    if arch == "deepseek_v2":
        kw = dict(common, num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
                  n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                  routed_scaling_factor=2.0, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=24, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        kw.update(over)
        return transformers.DeepseekV2Config(**kw), transformers.DeepseekV2ForCausalLM
    raise ValueError(arch)


def make_moe_model(path: pathlib.Path, arch: str, *, seed: int = 0, shard: bool = False, **over) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg, cls = moe_config(arch, make_tokenizer_files(path), **over)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    # random init gives near-uniform logits and routing; scale weights up so greedy decoding and
    # the routers have clear winners (ties would make the choice depend on rounding)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3 if name.endswith("gate.weight") else 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    kwargs = {"max_shard_size": "200KB"} if shard else {}
    model.save_pretrained(str(path), **kwargs)
    return path
