"""A model the generator platform cannot run is refused before any process starts, naming the fix."""

import pytest
from datasets import Dataset
from transformers import LlamaConfig, Qwen3MoeConfig

from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
from hfllamarl.runtime.generation.preflight import PreflightError, check_generator, cpu_attention_head_sizes, cpu_has_bf16
from hfllamarl.testing.tiny import build_tiny_model, successor_rows


def llama(**kw):
    base = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=64)
    return LlamaConfig(**{**base, **kw})


def test_head_size_the_cpu_backend_lacks_is_refused():
    with pytest.raises(PreflightError, match=r"heads of size 16; vLLM's CPU attention backend supports \[32, 64"):
        check_generator(llama(hidden_size=64), use_cpu=True, dtype="float32", tensor_parallel_size=1)
    check_generator(llama(), use_cpu=True, dtype="float32", tensor_parallel_size=1)  # head size 32 runs
    check_generator(llama(hidden_size=64), use_cpu=False, dtype="float32", tensor_parallel_size=1)  # GPUs: no limit


def test_heads_that_do_not_split_over_the_tensor_parallel_ranks():
    with pytest.raises(PreflightError, match="4 attention heads, which do not split over .*=3"):
        check_generator(llama(), use_cpu=True, dtype="float32", tensor_parallel_size=3)
    with pytest.raises(PreflightError, match="6 KV heads and generator_tensor_parallel_size=4"):
        check_generator(llama(hidden_size=384, num_attention_heads=12, num_key_value_heads=6), use_cpu=True,
                        dtype="float32", tensor_parallel_size=4)
    # Fewer KV heads than ranks: vLLM replicates them.
    check_generator(llama(num_key_value_heads=1), use_cpu=True, dtype="float32", tensor_parallel_size=4)


def test_mixture_of_experts_is_refused_on_the_cpu():
    moe = Qwen3MoeConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                         vocab_size=64)
    with pytest.raises(PreflightError, match="mixture of experts.*cannot reload its expert weights.*GPU generators"):
        check_generator(moe, use_cpu=True, dtype="float32", tensor_parallel_size=1)
    check_generator(moe, use_cpu=False, dtype="bfloat16", tensor_parallel_size=2)


@pytest.mark.skipif(cpu_has_bf16(), reason="this CPU has bf16 instructions")
def test_bf16_engine_on_a_cpu_without_bf16_is_refused():
    with pytest.raises(PreflightError, match="no bf16 instructions.*SIGILL.*generator_dtype='float32'"):
        check_generator(llama(), use_cpu=True, dtype="bfloat16", tensor_parallel_size=1)


@pytest.mark.slow
def test_head_sizes_are_vllms_own():
    """Read from vLLM's source without importing it; the same list vLLM reports once imported."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert cpu_attention_head_sizes() == tuple(CPUAttentionBackend.get_supported_head_sizes())


def test_trainer_refuses_before_starting_anything(tmp_path):
    """The trainer checks at construction, before a generator process exists."""
    path = build_tiny_model(str(tmp_path / "m"), hidden_size=64, num_heads=4)  # head size 16
    config = AsyncAIPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=4, report_to="none", max_steps=1)
    with pytest.raises(PreflightError, match="heads of size 16"):
        AsyncAIPOTrainer(path, reward_funcs="math_sympy", args=config, train_dataset=Dataset.from_list(successor_rows(8)))
    assert not config.topology._children


def test_transformers_backend_with_cpu_tensor_parallelism_is_refused():
    with pytest.raises(PreflightError, match="transformers backend sets up its tensor-parallel shared memory twice"):
        check_generator(llama(), use_cpu=True, dtype="float32", tensor_parallel_size=2, model_impl="transformers")
    check_generator(llama(), use_cpu=True, dtype="float32", tensor_parallel_size=1, model_impl="transformers")
