"""deepinfer_kernels.cpu: the one place that knows the CPU. Level detection from the OS's feature flags,
DEEPINFER_CPU forcing (lower levels only, refused by name otherwise), the per-level build of the native
library, torch's dispatch held to a forced level, and a CPU without x86 SIMD running on torch alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_kernels import cpu

ROOT = Path(__file__).resolve().parents[2]

# /proc/cpuinfo flag sets of the CPUs this project has met (abridged to what the levels read)
ZEN3 = {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}
ALDER_LAKE = ZEN3 | {"avx_vnni"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}


def _info(flags, arch="x86_64", asked=None):
    detected = cpu._highest(arch, set(flags))
    return cpu.CpuInfo(arch, "test cpu", frozenset(flags), detected, cpu._resolve(detected, set(flags), asked, arch),
                       asked is not None)


@pytest.mark.parametrize("flags,level", [(ZEN3, "avx2"), (ZEN4, "avx512"), (ALDER_LAKE, "avx2"),
                                         (SKYLAKE_X, "avx512"), ({"sse2", "avx"}, "generic"),
                                         ({"avx2", "f16c"}, "generic")])  # AVX2 without FMA is not the avx2 level
def test_level_is_the_highest_whose_features_are_all_there(flags, level):
    assert _info(flags).level == level


def test_features_are_those_of_the_level_in_force():
    zen4 = _info(ZEN4)
    assert {"avx512_bf16", "avx512_vnni", "avx512f", "fma"} <= zen4.features()
    forced = _info(ZEN4, asked="avx2")
    assert forced.level == "avx2" and forced.detected == "avx512"
    assert "avx512_bf16" not in forced.features() and "avx512f" not in forced.features()
    assert "avx_vnni" in _info(ALDER_LAKE).features()  # AVX-VNNI: the avx2 level's int8 dot
    assert "avx512_vnni" not in _info(SKYLAKE_X).features()  # only what the CPU has
    assert _info(ZEN4, asked="generic").features() == frozenset()


def test_a_level_above_the_cpu_or_an_unknown_name_is_refused_by_name():
    with pytest.raises(cpu.CpuLevelError, match=r"avx512.*lacks avx512f, avx512bw, avx512dq, avx512vl"):
        _info(ZEN3, asked="avx512")
    with pytest.raises(cpu.CpuLevelError, match=r"names no CPU level; use one of generic, avx2, avx512"):
        _info(ZEN4, asked="sse9")
    with pytest.raises(cpu.CpuLevelError, match=r"lacks x86 SIMD \(it is aarch64\)"):
        _info({"asimd"}, arch="aarch64", asked="avx2")
    assert _info(ZEN4, asked=" AVX2 ").level == "avx2"  # case and spaces


def test_each_level_builds_for_a_fixed_target_never_the_build_host():
    flags = ZEN4 | {"avx_vnni"}
    for level, march in (("generic", "x86-64"), ("avx2", "x86-64-v3"), ("avx512", "x86-64-v4")):
        got = cpu.compiler_flags(cpu.CpuInfo("x86_64", "t", frozenset(flags), "avx512", level, True))
        assert got[:2] == [f"-march={march}", "-mtune=generic"] and "-march=native" not in got
        assert set(got[2:]) == {"generic": set(), "avx2": {"-mavxvnni"},
                                "avx512": {"-mavxvnni", "-mavx512vnni", "-mavx512bf16"}}[level]


def _run(code: str, **env) -> dict:
    e = dict(os.environ)
    e.pop("DEEPINFER_CPU", None)
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        e.pop(var, None)  # (the suite itself may run under a forced level)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_PROBE = """
    import json, torch, deepinfer
    from deepinfer_kernels import cpu, native, quant
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 96, generator=g), torch.randn(7, 96, generator=g)
    y = native.linear(x, native.pack_weight(w)) if native.available() else None
    print(json.dumps({"level": cpu.level(), "kernel_level": quant.cpu_level() if native.available() else None,
                      "torch": torch.backends.cpu.get_cpu_capability(), "y": y.tolist() if y is not None else None,
                      "bf16dot": native.bf16_dot_level() if native.available() else None}))
"""


@pytest.mark.skipif(cpu.info().detected == "generic", reason="the CPU lacks AVX2 + FMA + F16C: no level to force but generic")
def test_forced_levels_run_their_own_build_and_hold_torch_to_them():
    here = cpu.info().detected
    avx2 = _run(_PROBE, DEEPINFER_CPU="avx2")
    assert avx2["level"] == "avx2" and avx2["kernel_level"] == 1 and avx2["bf16dot"] == 0
    assert avx2["torch"] == "AVX2"
    generic = _run(_PROBE, DEEPINFER_CPU="generic")
    assert generic["level"] == "generic" and generic["kernel_level"] == 0 and generic["torch"] == "DEFAULT"
    # the panel GEMM at every level: one multiply-add chain per output, so the AVX2 tile gives the
    # AVX-512 tile's bits (plain x86-64 has no FMA: there the products round before the adds)
    ref = torch.tensor(avx2["y"])
    assert torch.allclose(torch.tensor(generic["y"]), ref, rtol=1e-5, atol=1e-5)
    if here == "avx512":
        top = _run(_PROBE)
        assert top["level"] == "avx512" and top["kernel_level"] >= 2
        assert torch.equal(torch.tensor(top["y"]), ref)


def test_a_bad_deepinfer_cpu_fails_the_kernels_and_the_engine_by_name():
    r = subprocess.run([sys.executable, "-c", "from deepinfer_kernels import native; native.load()"],
                       capture_output=True, text=True, env={**os.environ, "DEEPINFER_CPU": "avx1024"}, cwd=ROOT)
    assert r.returncode != 0 and "CpuLevelError" in r.stderr and "DEEPINFER_CPU='avx1024' names no CPU level" in r.stderr


def test_a_cpu_without_x86_simd_runs_every_op_on_torch(tiny_models, tmp_path):
    """An aarch64 machine (simulated: the architecture and its /proc/cpuinfo Features): the native
    library is not built (its C is x86 code), the level is generic, and an engine still loads and
    generates, its greedy tokens those of transformers."""
    transformers = pytest.importorskip("transformers")
    code = f"""
        import json, platform, warnings
        platform.machine = lambda: "aarch64"
        import deepinfer_kernels.cpu as c
        c._read_cpuinfo = lambda: ("Neoverse-N1", {{"fp", "asimd", "sve", "atomics"}})
        c.info.cache_clear()  # (read once already, when deepinfer_kernels.cpu was imported)
        import torch
        from deepinfer import Engine, SamplingParams
        from deepinfer_kernels import native
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = native.available()
        eng = Engine({str(tiny_models["llama"])!r}, kv_cache_memory=8 << 20, block_size=4)
        out = eng.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        print(json.dumps({{"available": available, "warned": [str(w.message) for w in caught],
                          "level": c.level(), "flags": sorted(c.info().flags), "ids": out.prompt_token_ids,
                          "tokens": out.token_ids, "precision": eng.precision, "cpu": eng.cpu}}))
    """
    got = _run(code, DEEPINFER_CACHE_DIR=str(tmp_path))
    assert got["available"] is False and any("x86 code; this CPU is aarch64" in w for w in got["warned"])
    assert got["level"] == "generic" and "asimd" in got["flags"] and got["cpu"].startswith("generic on Neoverse-N1")
    assert got["precision"] == "float32"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([got["ids"]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got["tokens"] == ref[0, len(got["ids"]):].tolist()
