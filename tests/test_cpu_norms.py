"""The CPU generator's RMS norms run vLLM's compiled kernels (`engine._cpu_norm_kernels`): checked against
transformers' own `LlamaRMSNorm` computed in fp32 (an independent reference), with the native path kept for the
arguments the kernels do not take. (The engine-level check, pi/mu == 1 against the trainer's transformers model on
real families including Qwen3's per-head q/k norms, is `test_families.py`.)"""

import pytest
import torch

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def ops():
    from vllm import ir

    from hfllamarl.runtime.generation.engine import CPU_NORM_PROVIDER, _cpu_norm_kernels

    priority = _cpu_norm_kernels()
    if not priority:
        pytest.skip("this vLLM build has no CPU RMS-norm kernels")
    assert priority == {"rms_norm": [CPU_NORM_PROVIDER], "fused_add_rms_norm": [CPU_NORM_PROVIDER]}
    assert _cpu_norm_kernels() == priority  # a second engine in the process registers nothing twice
    return ir.ops


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm with its weight and input in fp32: the value both paths round."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        return norm(x.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_against_transformers(ops, dtype):
    from hfllamarl.runtime.generation.engine import CPU_NORM_PROVIDER

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 512, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(512, generator=g) / 4).to(dtype)
    ref = _reference(x, w, 1e-6)
    with ops.rms_norm.set_priority([CPU_NORM_PROVIDER, "native"]):
        assert ops.rms_norm.dispatch(x, w, 1e-6).provider == CPU_NORM_PROVIDER
        out = ops.rms_norm(x, w, 1e-6)
    native = ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    err, native_err = (out.float() - ref).abs(), (native.float() - ref).abs()
    if dtype == torch.float32:
        assert err.max() < 1e-5, err.max()
    else:  # one rounding to bf16 (at most 2**-8 relative) where the native path rounds twice
        assert (err <= ref.abs() * (2 ** -8 + 1e-6)).all(), (err / ref.abs()).max()
        assert err.max() < native_err.max() and err.mean() < native_err.mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_kernel_in_place_against_transformers(ops, dtype):
    from hfllamarl.runtime.generation.engine import CPU_NORM_PROVIDER

    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=g).to(dtype)
    residual = torch.randn(7, 256, generator=g).to(dtype)
    w = (1 + torch.randn(256, generator=g) / 4).to(dtype)
    summed = (x.float() + residual.float()).to(dtype)  # what the layer carries on: the sum in the model's dtype
    ref = _reference(summed, w, 1e-5)
    x_in, r_in = x.clone(), residual.clone()
    with ops.fused_add_rms_norm.set_priority([CPU_NORM_PROVIDER, "native"]):
        assert ops.fused_add_rms_norm.dispatch(x_in, r_in, w, 1e-5).provider == CPU_NORM_PROVIDER
        out, new_residual = ops.fused_add_rms_norm(x_in, r_in, w, 1e-5)
    assert torch.equal(new_residual, summed)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the kernel normalises the rounded sum, as it carries it
    assert ((out.float() - ref).abs() <= ref.abs() * tol + 1e-6).all()


def test_arguments_the_kernels_do_not_take_go_to_the_native_path(ops):
    from hfllamarl.runtime.generation.engine import CPU_NORM_PROVIDER

    x = torch.randn(8, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    strided = torch.randn(64, 8).to(torch.bfloat16).t()  # a transposed view
    with ops.rms_norm.set_priority([CPU_NORM_PROVIDER, "native"]):
        assert ops.rms_norm.dispatch(strided, w, 1e-6).provider == "native"
        assert ops.rms_norm.dispatch(x, w.float(), 1e-6).provider == "native"  # a weight of another dtype
        assert ops.rms_norm.dispatch(x, w, 1e-6, 32).provider == "native"  # a variance over part of the width
        assert ops.rms_norm.dispatch(x, None, 1e-6).provider == "native"
        out = ops.rms_norm(strided, w, 1e-6)
    assert torch.allclose(out.float(), _reference(strided, w, 1e-6), rtol=2 ** -7, atol=0)
