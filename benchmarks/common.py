"""Helpers shared by the benchmark scripts (prompts, timing, the HF reference model)."""

from __future__ import annotations

import random
import time

import torch

TOPICS = [
    "the history of Rome", "how vaccines work", "the water cycle", "machine learning", "the French Revolution",
    "black holes", "photosynthesis", "the stock market", "climate change", "the human heart", "volcanoes",
    "the internet", "ancient Egypt", "quantum computing", "the Moon landing", "honey bees",
]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """n short (~20-token) prompts."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        t = r.choice(TOPICS)
        out.append(f"Question {i}: Please write a short paragraph that explains {t} to a curious student.")
    return out


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    r = fn(*args, **kwargs)
    return r, time.perf_counter() - t


def best_ms(fn, reps: int = 30) -> float:
    """Best-of-reps wall time of fn() in milliseconds, after one warm-up call (best-of, because the
    machine is shared and noisy)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Measured memory read bandwidth (GB/s): best sum over a buffer much larger than the caches.

    The buffer holds random values, like weights: a constant buffer (torch.ones) measured up to
    57 GB/s on this VM, likely because the host merges identical pages, against ~31 GB/s for
    random data (what reading real weights sees)."""
    x = torch.rand(num_bytes // 4, dtype=torch.float32)
    return num_bytes / (best_ms(x.sum, repeats) / 1e3) / 1e9


def hf_reference_model(model: str | None = None):
    """A transformers Llama/Qwen model holding exactly the weights DeepInfer loads (fp32)."""
    import transformers

    from deepinfer.engine.loader import load_model

    loaded = load_model(model)
    c = loaded.config
    kinds = {
        "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = kinds[c.architecture]
    cfg = cfg_cls(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    hf = model_cls(cfg).float().eval()
    missing, unexpected = hf.load_state_dict(loaded.weights, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF reference: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf, loaded.tokenizer


def save_random_moe(model, path: str, dtype: torch.dtype = torch.float32) -> str:
    """Random MoE weights with clear routing winners (router rows wider than the rest), saved as an HF dir
    in `dtype` (the model is left in that dtype)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3 if name.endswith("gate.weight") else 0.03)
    model.to(dtype).save_pretrained(path)
    return path


def run_on_compute_thread(main) -> None:
    """Run a benchmark's main() on deepinfer's compute thread (deepinfer/engine/compute_thread.py),
    where every CPU engine runs its kernels. A script that also runs torch work of its own (the
    transformers reference, a GEMM measured directly) would otherwise start OpenMP regions from a
    second thread, and libgomp then cuts its barrier spin for both: measured on the 2-core host,
    benchmarks/moe.py's DeepSeek-V3 model ran 36.9 / 158.6 tok/s at batch 1 / 8 with transformers in
    the main thread, 73.3 / 235.5 with everything on one thread."""
    from deepinfer.engine.compute_thread import compute_thread

    compute_thread().run(main)
