"""Every GPU-style kernel lowers to CUDA source for sm_90a (no GPU needed) and builds with nvcc."""

import pytest

from deepinfer_kernels import _tilelang, fp8_gemm, grouped_gemm, noise, paged_attention, rmsnorm, sampling

GPU_BUILDERS = {
    "masked_sample": sampling.build_gpu,
    "masked_sample_mass": sampling.build_gpu_mass,
    "masked_sample_merge": sampling.build_gpu_merge,
    "gumbel_noise": noise.build_gpu,
    "rmsnorm_f32_576": lambda: rmsnorm.build_gpu(576, 1e-5, "float32"),
    "attention_split_f32": lambda: paged_attention.build_gpu_split(9, 3, 64, 16, 0.125, "float32"),
    "attention_merge_f32": lambda: paged_attention.build_gpu_merge(9, 64, "float32"),
    "grouped_gemm_gated_bf16": lambda: grouped_gemm.build_gpu(96, 256, True, "bfloat16"),
    "grouped_gemm_f32": lambda: grouped_gemm.build_gpu(256, 96, False, "float32"),
    "fp8_gemm_bf16": lambda: fp8_gemm.build_gpu(320, 300, 128, "bfloat16"),
    "fp8_gemm_split4_bf16": lambda: fp8_gemm.build_gpu(320, 1100, 128, "bfloat16", split=4),
    "fp8_grouped_gated_bf16": lambda: grouped_gemm.build_gpu(96, 256, True, "bfloat16", fp8_block=128),
    "fp8_grouped_f16": lambda: grouped_gemm.build_gpu(256, 96, False, "float16", fp8_block=128),
}
SLOW_BUILDERS = {
    "rmsnorm_bf16_4096": lambda: rmsnorm.build_gpu(4096, 1e-6, "bfloat16"),
    "attention_split_bf16_d128": lambda: paged_attention.build_gpu_split(32, 8, 128, 16, 128**-0.5, "bfloat16"),
    "attention_merge_bf16_d128": lambda: paged_attention.build_gpu_merge(32, 128, "bfloat16"),
}


@pytest.mark.parametrize("name", sorted(GPU_BUILDERS))
def test_lowers_to_cuda_source(tilelang_available, name):
    src = _tilelang.lower_cuda_source(GPU_BUILDERS[name]())
    assert "__global__" in src
    # The sampling maths must not leave float rounding to nvcc's contraction choices.
    if name == "gumbel_noise":
        assert "__fmul_rn" in src and "__fdiv_rn" in src
    if name.startswith("masked_sample"):  # x / T rounded as the torch path rounds it
        assert "__fdiv_rn" in src
    if name.startswith("fp8_"):  # weights read as bytes, decoded through the table in shared memory
        assert "const uchar* __restrict__ w" in src and "lut_s" in src


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GPU_BUILDERS) + sorted(SLOW_BUILDERS))
def test_builds_with_nvcc(tilelang_available, nvcc_available, name):
    build = {**GPU_BUILDERS, **SLOW_BUILDERS}[name]
    kern = _tilelang.compile_cached(("nvcc-build-test", name), build, "cuda")
    assert "__global__" in kern.get_kernel_source()
