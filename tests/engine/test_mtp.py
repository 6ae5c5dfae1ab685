"""DeepSeek-V3's MTP layer: loaded from the checkpoint and exposed as `mtp_logits` (a drafter's entry
point), checked against transformers' own decoder layer running the same weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from deepinfer import Engine
from deepinfer.engine.attention import ForwardContext, PrefillChunk
from deepinfer.errors import ModelLoadError
from moe_factory import make_moe_model, moe_config

transformers = pytest.importorskip("transformers")


def _with_mtp(tmp_path, drop: str | None = None):
    """A 2-layer DeepSeek-V3 whose checkpoint also carries an MTP layer (index 2): its decoder block
    is the layer of a second, 1-layer MoE model (returned as the reference, with its final norm and
    lm_head set to the MTP's shared head)."""
    from safetensors.torch import load_file, save_file

    main = make_moe_model(tmp_path / "main", "deepseek_v3", seed=31, num_hidden_layers=2, num_nextn_predict_layers=1)
    vocab = json.loads((main / "config.json").read_text())["vocab_size"]
    cfg, cls = moe_config("deepseek_v3", vocab, num_hidden_layers=1, first_k_dense_replace=0)
    torch.manual_seed(32)
    ref = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3 if name.endswith("gate.weight") else 0.08)
            elif name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    ref.save_pretrained(str(tmp_path / "ref"))
    w = load_file(str(main / "model.safetensors"))
    blk = load_file(str(tmp_path / "ref" / "model.safetensors"))
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(33)
    extra = {
        "model.layers.2.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "model.layers.2.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "model.layers.2.eh_proj.weight": 0.08 * torch.randn(h, 2 * h, generator=g),
        "model.layers.2.shared_head.norm.weight": blk["model.norm.weight"].clone(),
        "model.layers.2.shared_head.head.weight": blk["lm_head.weight"].clone(),
        "model.layers.2.embed_tokens.weight": w["model.embed_tokens.weight"].clone(),
    }
    for n, t in blk.items():
        if n.startswith("model.layers.0."):
            extra["model.layers.2." + n[len("model.layers.0."):]] = t
    if drop:
        del extra[drop]
    w.update(extra)
    save_file(w, str(main / "model.safetensors"), metadata={"format": "pt"})
    return main, ref, extra


def test_mtp_logits_match_a_transformers_decoder_layer(tmp_path):
    path, ref, extra = _with_mtp(tmp_path)
    eng = Engine(str(path), kv_cache_memory=1 << 20, block_size=4)
    model = eng.runner.model
    assert model.num_mtp_layers == 1
    hf_main = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    T = len(ids) - 1
    with torch.no_grad():
        hidden = hf_main.model(torch.tensor([ids[:-1]])).last_hidden_state[0]  # h_i at positions 0..T-1
        # reference: eh_proj([enorm(embed(x_{i+1})); hnorm(h_i)]) through the HF layer, final norm, head
        rms = lambda x, wt: F.rms_norm(x, (x.shape[-1],), wt, 1e-6)  # noqa: E731
        e = rms(F.embedding(torch.tensor(ids[1:]), extra["model.layers.2.embed_tokens.weight"]),
                extra["model.layers.2.enorm.weight"])
        x = torch.cat([e, rms(hidden, extra["model.layers.2.hnorm.weight"])], -1) @ extra["model.layers.2.eh_proj.weight"].T
        want = ref(inputs_embeds=x[None], position_ids=torch.arange(T)[None]).logits[0]
        a = model.config.mla
        cache = torch.zeros(T, 1, a.kv_lora_rank + a.qk_rope_head_dim)
        meta = ForwardContext(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, None)],
                               linear=eng.runner.linear)  # the engine's panels: its projections' one copy
        got = model.mtp_logits(torch.tensor(ids[1:]), torch.arange(T), hidden, meta, (cache,))
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    with pytest.raises(IndexError, match="MTP layer 1"):
        model.mtp_logits(torch.tensor(ids[1:]), torch.arange(T), hidden, meta, (cache,), depth=1)


def test_partial_mtp_layer_is_named(tmp_path):
    path, _, _ = _with_mtp(tmp_path, drop="model.layers.2.eh_proj.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.eh_proj\.weight"):
        Engine(str(path), kv_cache_memory=1 << 20)


def test_checkpoint_without_mtp_has_none(tmp_path):
    path = make_moe_model(tmp_path / "m", "deepseek_v3", seed=1, num_hidden_layers=2, num_nextn_predict_layers=1)
    assert Engine(str(path), kv_cache_memory=1 << 20).runner.model.num_mtp_layers == 0
