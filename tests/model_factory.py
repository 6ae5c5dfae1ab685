"""Tiny random-weight models saved as Hugging Face directories, for tests and their references."""

from __future__ import annotations

import json
import pathlib

import torch

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def add(a, b):\n    return a + b\n 0123456789 {\"name\": \"x\", \"age\": 42} [1, 2, 3] "
    "Hello world! How are you today? I am fine, thank you. "
) * 20


def make_tokenizer_files(path: pathlib.Path, vocab_size: int = 384) -> int:
    """Train a tiny byte-level BPE tokenizer with chat special tokens; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_CORPUS], trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": template,
            }
        )
    )
    return tok.get_vocab_size()


def make_tiny_model(path: pathlib.Path, arch: str, *, tie: bool = False, seed: int = 0, shard: bool = False,
                    dtype: torch.dtype = torch.float32, **overrides) -> pathlib.Path:
    """dtype: the checkpoint's storage type (the weights are drawn in fp32, then rounded to it);
    overrides: config fields other than the defaults below (hidden_size=96, ...)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer_files(path)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=10000.0)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    # random init gives near-uniform logits; scale weights up so greedy decoding has clear winners
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "bias" in name:
                p.normal_(0, 0.05)
    kwargs = {"max_shard_size": "200KB"} if shard else {}
    model.to(dtype)
    model.save_pretrained(str(path), **kwargs)
    return path
