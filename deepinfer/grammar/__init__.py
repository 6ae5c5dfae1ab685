"""Structured generation: constraint specs, grammar backends (xgrammar, outlines-core),
token bitmasks, jump-forward decoding and output decoding.

Independent of deepinfer.engine: the engine builds one GrammarCompiler per model, compiles each
request's spec (cached), and per decode step fills a bitmask row from the request's matcher,
applies the bitmask to the logits and feeds the sampled token back with accept_token.
"""

from deepinfer.grammar.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer.grammar.bitmask import (
    allocate_token_bitmask,
    allowed_token_ids,
    apply_token_bitmask_,
    apply_token_bitmask_reference_,
)
from deepinfer.grammar.compiler import GrammarCompiler
from deepinfer.grammar.decode import decode_output
from deepinfer.grammar.jump_forward import JumpForward, jump_forward
from deepinfer.grammar.spec import GrammarSpec, schema_from_type, spec_from_params, spec_of

__all__ = [
    "CompiledGrammar", "GrammarBackend", "GrammarCompiler", "GrammarMatcher", "GrammarSpec", "JumpForward",
    "allocate_token_bitmask", "allowed_token_ids", "apply_token_bitmask_", "apply_token_bitmask_reference_",
    "decode_output", "jump_forward", "schema_from_type", "spec_from_params", "spec_of",
]
