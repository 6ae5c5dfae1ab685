"""A GGUF whose projections are k-quants (Q4_K, Q6_K), written here with the gguf package from a tiny
random llama and this project's own packer: the loader keeps the blocks as stored (q/k unpermuted),
and the engine on them (dtype="quantized_exact" / "quantized") tracks the fp32 path on the same file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepinfer.engine.loader import load_model
from deepinfer.engine.placeholder import is_placeholder
from deepinfer_kernels import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels did not build")

CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _fmt(hf: str) -> int | None:
    """The mix llama.cpp's Q4_K_M recipe uses: Q6_K for embedding, output and down, Q4_K elsewhere;
    layer 1's k_proj left F32 (its fused q|k|v group then runs in fp32 whole)."""
    if hf == "model.layers.1.self_attn.k_proj.weight":
        return None
    if hf.endswith(("embed_tokens.weight", "lm_head.weight", "down_proj.weight")):
        return quant.Q6_K
    if hf.endswith("_proj.weight"):
        return quant.Q4_K
    return None  # norms stay F32


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter's q/k row order
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory, tiny_tok):
    import gguf
    import transformers

    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=tiny_tok.vocab_size, tie_word_embeddings=False, rope_theta=10000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                   **CFG)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(CFG["num_hidden_layers"])
    w.add_context_length(256)
    w.add_embedding_length(CFG["hidden_size"])
    w.add_feed_forward_length(CFG["intermediate_size"])
    w.add_head_count(CFG["num_attention_heads"])
    w.add_head_count_kv(CFG["num_key_value_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    merges = json.loads(tiny_tok.hf.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([tiny_tok.id_to_token(i) for i in range(tiny_tok.vocab_size)])
    w.add_token_types([3 if i in tiny_tok.special_token_ids else 1 for i in range(tiny_tok.vocab_size)])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(tiny_tok.chat_template)
    decoded = {}  # HF name -> what the file's blocks decode to (HF row order)
    for name, t in sd.items():
        a = t.numpy()
        heads = {"q_proj": CFG["num_attention_heads"], "k_proj": CFG["num_key_value_heads"]}
        for part, h in heads.items():
            if name.endswith(f"{part}.weight"):
                a = _permute(a, h)
        gname = TOP.get(name) or "blk.{}.{}".format(name.split(".")[2], LAYER[name.split(".", 3)[3]])
        fmt = _fmt(name)
        if fmt is None:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
            decoded[name] = t
            continue
        qw = quant.pack(torch.from_numpy(np.ascontiguousarray(a)), fmt)
        w.add_tensor(gname, qw.data.numpy(), raw_dtype=gguf.GGMLQuantizationType(fmt))
        d = quant.dequantize_reference(qw).numpy()
        for part, h in heads.items():
            if name.endswith(f"{part}.weight"):  # back to HF order: the inverse permutation
                d = d.reshape(h, d.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(d.shape)
        decoded[name] = torch.from_numpy(np.ascontiguousarray(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, decoded


def test_loader_keeps_kquant_blocks_as_stored(kquant_gguf, tmp_path):
    path, decoded = kquant_gguf
    loaded = load_model(path, cache_dir=tmp_path, keep_quantized=True)
    q = loaded.quantized
    assert q["model.layers.0.self_attn.q_proj.weight"].format_name == "Q4_K"
    assert q["model.layers.1.mlp.down_proj.weight"].format_name == "Q6_K"
    assert q["lm_head.weight"].format_name == "Q6_K" and q["model.embed_tokens.weight"].format_name == "Q6_K"
    assert "model.norm.weight" not in q
    # layer 1's q|k|v: k is F32 in the file, so q and v are dequantised too (one fused fp32 matrix)
    for part in "qkv":
        name = f"model.layers.1.self_attn.{part}_proj.weight"
        assert name not in q and not is_placeholder(loaded.weights[name])
        torch.testing.assert_close(loaded.weights[name], decoded[name], rtol=0, atol=0)
    fp32 = load_model(path, cache_dir=tmp_path).weights  # the fp32 path: the gguf package's decoder
    for name, qw in q.items():
        # the blocks (q/k rows unpermuted) decode to the matrix written, as the fp32 loader's does;
        # the quantised load holds no fp32 copy of them, only a 4-byte placeholder
        torch.testing.assert_close(quant.dequantize_reference(qw), decoded[name], rtol=0, atol=0)
        torch.testing.assert_close(fp32[name], decoded[name], rtol=0, atol=0)
        assert is_placeholder(loaded.weights[name]) and loaded.weights[name].untyped_storage().nbytes() == 4
    assert torch.equal(loaded.weights["model.norm.weight"], fp32["model.norm.weight"])


@pytest.mark.parametrize("dtype,tol", [("quantized_exact", 1e-3), ("quantized", 0.3)])
def test_engine_on_kquant_blocks_tracks_fp32(kquant_gguf, tmp_path, dtype, tol):
    from deepinfer import Engine, SamplingParams

    path, _ = kquant_gguf
    opts = dict(cache_dir=str(tmp_path), kv_cache_memory=8 << 20)
    ref, eng = Engine(str(path), dtype="float32", **opts), Engine(str(path), dtype=dtype, **opts)
    assert eng.precision == {"quantized_exact": "quantized-exact", "quantized": "quantized-int8"}[dtype]
    # within 1.2x the file, but for layer 1's q and v, dequantised to fp32 (their group has an F32 part)
    fp32_extra = 2 * CFG["hidden_size"] ** 2 * 4
    assert eng.stats.weight_bytes <= 1.2 * eng.stats.checkpoint_bytes + fp32_extra, (eng.stats.weight_bytes,
                                                                                     eng.stats.checkpoint_bytes)
    prompts = [[5, 9, 200, 31, 77, 120, 3, 64, 18, 250, 99, 7], [40, 41, 42, 43, 44, 45, 46, 47]]
    sp = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    a, b = ref.generate(prompts, sp), eng.generate(prompts, sp)
    worst = 0.0
    for x, y in zip(a, b):
        pa = [t.logprob for t in x.prompt_logprobs if t is not None]
        pb = [t.logprob for t in y.prompt_logprobs if t is not None]
        worst = max(worst, max(abs(u - v) for u, v in zip(pa, pb)))
        if dtype == "quantized_exact":
            assert x.token_ids == y.token_ids
    print(f"{dtype} on Q4_K/Q6_K: max prompt logprob diff vs fp32 {worst:.2e}")
    assert 0 < worst < tol


# a prompt of 40 tokens: its prefill runs the projections at 40 rows, past quant_linear.BF16_M
LONG = [(7 * i + 3) % 250 + 3 for i in range(40)]


@pytest.mark.skipif(not quant.available() or quant.cpu_level() < 3,
                    reason="the CPU level lacks AVX512_BF16: dtype='bfloat16' on a GGUF runs the exact kernels there")
def test_bfloat16_on_kquant_blocks_tracks_quantized_exact(kquant_gguf, tmp_path, monkeypatch):
    """dtype="bfloat16" on a GGUF: the blocks kept, bf16 products from BF16_M rows (prefill), the exact
    row kernels below (decode of two sequences). Its prompt logprobs against the same engine with the
    bf16 kernel replaced by its definition in torch (x and the dequantised weights rounded to bf16, the
    product in fp64), and against quantized_exact."""
    from deepinfer import Engine, SamplingParams

    path, _ = kquant_gguf
    opts = dict(cache_dir=str(tmp_path), kv_cache_memory=8 << 20)
    ref, eng = Engine(str(path), dtype="quantized_exact", **opts), Engine(str(path), dtype="bfloat16", **opts)
    assert eng.precision == "quantized-bf16" and eng.dtype == torch.float32
    assert eng.stats.weight_bytes == ref.stats.weight_bytes
    prompts = [LONG, LONG[::-1][:24]]
    sp = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)

    def prompt_logprobs(e):
        e.reset_prefix_cache()
        return torch.tensor([t.logprob for o in e.generate(prompts, sp) for t in o.prompt_logprobs if t is not None])

    exact, bf16 = prompt_logprobs(ref), prompt_logprobs(eng)
    calls = []

    def defined(acc):
        def run(x, w, bias=None):
            calls.append(x.shape[0])
            y = x.bfloat16().to(acc) @ quant.dequantize_reference(w).bfloat16().to(acc).T
            return (y if bias is None else y + bias.to(acc)).float()
        return run

    monkeypatch.setattr(quant, "qlinear_bf16", defined(torch.float64))
    def64 = prompt_logprobs(eng)
    assert calls and min(calls) >= 16  # the prefills' projections went through it
    monkeypatch.setattr(quant, "qlinear_bf16", defined(torch.float32))
    def32 = prompt_logprobs(eng)
    d_kernel, d_def32, d_exact = (bf16 - def64).abs(), (def32 - def64).abs(), (bf16 - exact).abs()
    print(f"bfloat16 on Q4_K/Q6_K, prompt logprob diff median / max: kernel vs definition "
          f"{d_kernel.median():.1e} / {d_kernel.max():.1e}, the definition summed in fp32 vs fp64 "
          f"{d_def32.median():.1e} / {d_def32.max():.1e}, kernel vs quantized_exact "
          f"{d_exact.median():.1e} / {d_exact.max():.1e}")
    # An fp32 summation order alone moves the logprobs by ~1e-3 here (an activation crossing a bf16
    # rounding boundary changes what the next layer multiplies): the kernel must be no farther from the
    # definition than torch's own fp32 evaluation of it (measured 1.2e-3 / 8.1e-3, and 1.1e-3 / 8.1e-3)
    assert d_kernel.median() < 2 * d_def32.median() + 1e-5 and d_kernel.max() < 2 * d_def32.max() + 1e-5
    # quantized_exact multiplies the operands unrounded: measured 9.2e-3 / 5.3e-2
    assert d_exact.median() > 3 * d_kernel.median() and d_exact.max() < 0.15
