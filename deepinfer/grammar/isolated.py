"""Compiling a large spec in a worker process: a compile that runs past its deadline or its memory is
killed, and its memory goes back with the process.

Why (issue 51): an in-process xgrammar compile cannot be interrupted. On a 1.17 MB schema (9,000
optional properties) an abandoned compile kept running in its thread (1.4 -> 4.6 GB after 540 s),
and with 18,000 properties (2.3 MB) the engine grew to 24 GB and was OOM-killed with its whole batch;
outlines-core grew ~290 MB/s on the 9,000-property one. So a spec past `GrammarCompiler.isolate_bytes`
compiles on xgrammar here, in a fresh interpreter (`python -m deepinfer.grammar.isolated`, never
multiprocessing's spawn, which would re-run the user's main script), under RLIMIT_AS, killed at the
deadline; the compiled grammar comes back through xgrammar's `serialize_json` / `deserialize_json`.
outlines-core's index has no such form, so outlines does not serve a spec that large.

Protocol: the parent pickles {tokenizer (JSON text), vocab_size, stop_token_ids, strict_json, kind,
text} to the child's stdin; the child writes its pickled answer to the file named by argv[2]:
("ok", serialized grammar, warnings, strict) or ("error", "invalid" | "memory" | "other", message).
"""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
import tempfile

from deepinfer.errors import GrammarBudgetError, GrammarError, InvalidSpecError
from deepinfer.grammar.spec import GrammarSpec

#: backends that can compile in the worker (their compiled grammar serialises)
ISOLATABLE = ("xgrammar",)


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def compile_isolated(be, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int], strict_json: bool,
                     spec: GrammarSpec, timeout: float | None, memory: int):
    """Compile spec on xgrammar in a worker process with `memory` bytes of address space beyond what
    its imports take, killed after `timeout` seconds; the result is an XGrammarCompiled bound to the
    parent's backend `be` (its tokenizer info, first-byte and whitespace tables). Raises
    GrammarBudgetError past the deadline or the memory, GrammarError / InvalidSpecError as the
    in-process compile would."""
    from deepinfer.grammar.xgrammar_backend import XGrammarCompiled
    import xgrammar as xgr

    payload = pickle.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size, "stops": list(stop_token_ids),
                            "strict_json": strict_json, "kind": spec.kind, "text": spec.text})
    fd, out_path = tempfile.mkstemp(prefix="deepinfer-grammar-", suffix=".pkl")
    os.close(fd)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "deepinfer.grammar.isolated", str(int(memory)), out_path],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(payload, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise GrammarBudgetError(
                f"compiling this {spec.kind} spec ({len(spec.text.encode())} bytes) on xgrammar took longer "
                f"than {timeout:g}s: stopped (its worker process killed); raise grammar_compile_timeout "
                f"(GrammarCompiler compile_timeout) to allow more", budget="time", option="grammar_compile_timeout")
        with open(out_path, "rb") as f:
            data = f.read()
    finally:
        try:
            os.unlink(out_path)
        except OSError:
            pass
    answer = pickle.loads(data) if data else None
    memory_msg = (f"compiling this {spec.kind} spec ({len(spec.text.encode())} bytes) on xgrammar needed more than "
                  f"{memory / 2**30:.2g} GiB: stopped; raise grammar_compile_memory (GrammarCompiler "
                  f"compile_memory) to allow more")
    if answer is None:  # the worker died without answering: abort on bad_alloc, or a crash
        tail = (err or b"").decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        if proc.returncode in (-6, 134) or "bad_alloc" in tail[0] or "MemoryError" in tail[0]:
            raise GrammarBudgetError(memory_msg, budget="memory", option="grammar_compile_memory")
        raise GrammarError(f"xgrammar: the compile worker died ({tail[0][:200]})")
    if answer[0] == "ok":
        _, text, warnings, strict = answer
        cg = xgr.CompiledGrammar.deserialize_json(text, be.tokenizer_info)
        ws = be.ws_tables() if spec.kind in ("json_schema", "json_object") else None
        out = XGrammarCompiled(spec, cg, warnings, be.first_byte, ws)
        out.strict = strict
        return out
    _, what, msg = answer
    if what == "memory":
        raise GrammarBudgetError(memory_msg, budget="memory", option="grammar_compile_memory")
    if what == "invalid":
        raise InvalidSpecError(msg)
    raise GrammarError(msg)


def _main(memory: int, out_path: str) -> None:
    payload = pickle.loads(sys.stdin.buffer.read())
    import tokenizers

    from deepinfer.grammar.vocab import TokenizerVocab
    from deepinfer.grammar.xgrammar_backend import XGrammarBackend

    vocab = TokenizerVocab.from_tokenizer(tokenizers.Tokenizer.from_str(payload["tokenizer"]), payload["vocab_size"],
                                          payload["stops"])
    # one thread: a worker compiles one spec, and a thread started under the address-space limit
    # below can fail to get its stack (the limit test hung for 300 s in a loaded CI run)
    be = XGrammarBackend(vocab, max_threads=1, strict_json=payload["strict_json"])
    # the budget is the compile's own: what the imports and the vocabulary mapped is not counted
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + memory
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        compiled = be.compile(GrammarSpec(payload["kind"], payload["text"]))
        answer = ("ok", compiled.compiled.serialize_json(), list(compiled.warnings), bool(compiled.strict))
    except MemoryError:
        answer = ("error", "memory", "")
    except InvalidSpecError as e:
        answer = ("error", "invalid", str(e))
    except GrammarError as e:
        answer = ("error", "memory" if "bad_alloc" in str(e) else "other", str(e))
    except Exception as e:  # reported as this backend's failure
        answer = ("error", "memory" if "bad_alloc" in str(e) else "other", f"xgrammar: {type(e).__name__}: {e}")
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # room to write the answer
    with open(out_path, "wb") as f:
        pickle.dump(answer, f)


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2])
