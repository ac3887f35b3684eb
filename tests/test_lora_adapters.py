"""LoRA's adapter-only sync. Which LoRA weight sync a job gets (`lora_sync`), decided from the configuration alone: the cases that must send the
merged layers, the ones that may send the adapters, and a refused 'adapter' naming its reason."""

import pytest
from peft import LoraConfig
from transformers import LlamaConfig, GPT2Config

from hfllamarl.runtime.weights.lora_adapters import adapter_config, choose_lora_sync, engine_rank

LLAMA = LlamaConfig(architectures=["LlamaForCausalLM"])


def choose(requested="auto", peft=None, model_obj=None, config=LLAMA, **kw):
    return choose_lora_sync(requested, peft, model_obj, config, **kw)


def test_fresh_adapters_on_linear_layers_travel_alone_on_gpus_and_merged_on_the_cpu():
    peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    assert choose(peft=peft)[0] == "adapter"
    mode, why = choose(peft=peft, use_cpu=True)
    assert mode == "merged" and "CPU" in why
    assert choose("adapter", peft=peft, use_cpu=True)[0] == "adapter"  # asked for: honoured on the CPU too
    assert choose("merged", peft=peft)[0] == "merged"
    assert choose(peft=None) == ("none", "")


@pytest.mark.parametrize("peft, kw, reason", [
    (LoraConfig(r=8, init_lora_weights="pissa"), {}, "init_lora_weights"),
    (LoraConfig(r=8, rank_pattern={"q_proj": 4}), {}, "rank_pattern"),
    (LoraConfig(r=1024), {}, "r=1024"),
    (LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"]), {}, "embedding"),
    (LoraConfig(r=8, target_modules=".*proj"), {}, "pattern"),
    (LoraConfig(r=8), {"quantization": "fp8"}, "generator_quantization"),
    (LoraConfig(r=8), {"model_impl": "transformers"}, "vllm_model_impl"),
    (LoraConfig(r=8), {"config": GPT2Config(architectures=["GPT2LMHeadModel"])}, "GPT2LMHeadModel"),
])
def test_what_the_engine_cannot_apply_goes_merged_under_auto_and_is_refused_when_asked(peft, kw, reason):
    config = kw.pop("config", LLAMA)
    mode, why = choose(peft=peft, config=config, **kw)
    assert mode == "merged" and reason in why, why
    with pytest.raises(ValueError, match="cannot be honoured") as err:
        choose("adapter", peft=peft, config=config, **kw)
    assert reason in str(err.value)


def test_bad_values_and_adapter_without_lora_are_refused():
    with pytest.raises(ValueError, match="choose one of"):
        choose("adapters", peft=LoraConfig())
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        choose("adapter", peft=None)


def test_the_adapter_file_puts_the_scaling_in_b_and_the_engine_rank_holds_r():
    # vLLM's scaling is lora_alpha / r: 1 with lora_alpha = r, whatever the user's alpha (it went into B).
    config = adapter_config(LoraConfig(r=12, lora_alpha=48, use_rslora=True))
    assert config["lora_alpha"] == config["r"] == 12 and config["use_rslora"] is False
    assert [engine_rank(LoraConfig(r=r)) for r in (1, 2, 8, 12, 16, 300)] == [1, 8, 8, 16, 16, 320]


@pytest.mark.parametrize("indices", [[0] * 7, [0, 1, 1, 0, -1, 1, 0]])
def test_the_grouped_cpu_lora_ops_compute_what_vllms_own_ops_do(indices):
    """vLLM's CPU LoRA ops (the reference: its own torch ops, one adapter copy per token) against the grouped ones the
    generator installs, for one adapter and for a mix (with -1, a token without adapter), in fp32 and bf16 inputs."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from hfllamarl.runtime.weights.lora_adapters import cpu_lora_kernels

    cpu_lora_kernels()
    own = lora_ops._hfllamarl_own  # vLLM's own ops, as they were before
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 64, generator=g).to(dtype)
        a = torch.randn(2, 1, 16, 64, generator=g).to(dtype)  # [slots, 1, r, in]
        b = torch.randn(2, 1, 96, 16, generator=g).to(dtype)  # [slots, 1, out, r]
        h = torch.randn(7, 16, generator=g)
        outs = {}
        for which, ops in (("own", own), ("grouped", {n: getattr(lora_ops, n) for n in own})):
            shrunk = torch.zeros(7, 16)
            ops["bgmv_shrink"](x, a, shrunk, idx, 0.5)
            expanded = torch.ones(7, 96, dtype=dtype)
            ops["bgmv_expand"](h, b, expanded, idx, True)
            sliced = torch.ones(7, 200, dtype=dtype)
            ops["bgmv_expand_slice"](h, b, sliced, idx, 40, 96, True)
            outs[which] = (shrunk, expanded, sliced)
        assert lora_ops.bgmv_shrink is not own["bgmv_shrink"]
        for mine, theirs in zip(outs["grouped"], outs["own"]):
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(mine.float(), theirs.float(), rtol=tol, atol=tol * 8), (mine - theirs).abs().max()


def test_scratch_left_by_a_process_that_is_gone_is_swept_and_a_live_ones_kept(tmp_path, monkeypatch):
    """A generator that leaves by os._exit or SIGKILL keeps its adapter scratch: the next one to start removes it
    (named after its owner's pid), and never a directory whose owner still runs."""
    import os
    import subprocess
    import sys
    import tempfile

    from hfllamarl.runtime.world.processes import sweep_dead_owners

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"hfllamarl-lora-{int(gone.stdout)}-abc123"
    alive = tmp_path / f"hfllamarl-lora-{os.getpid()}-def456"
    other = tmp_path / f"hfllamarl-sandbox-{int(gone.stdout)}-ghi789"
    for d in (dead, alive, other):
        (d / "version-3").mkdir(parents=True)
    sweep_dead_owners("hfllamarl-lora-")
    assert not dead.exists() and alive.exists() and other.exists()
