"""LoRA in process: merged weights against peft's own merge_and_unload(), peft's init on the meta-device path,
peft's adapter files, and what a PeftModel / peft_config may be."""

import copy
import math

import pytest
import torch

from hfllamarl.runtime.weights.lora import MergedLoraWeights, check_peft_inputs, merged_state_dict


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from hfllamarl.testing.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("llama") / "model"), family="llama", seed=0)


def peft_model(path: str, targets, scale: float = 0.05, seed: int = 1):
    """A PeftModel on `path` with adapters set to random non-zero values (a trained adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(target_modules=targets, lora_alpha=16))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def test_merged_weights_equal_peft_merge_and_unload(llama):
    """Embedding (W + s (B A)^T), linear layers and their vLLM-fused siblings: what the generator gets equals the
    weights peft's own merge_and_unload() writes, and every other weight is the base's."""
    model = peft_model(llama, ["embed_tokens", "q_proj", "up_proj", "lm_head"])
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    ours = merged_state_dict(model)
    assert set(ours) == set(reference)
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-6, msg=key)
    base = model.get_base_model()
    emb = base.model.embed_tokens
    assert (reference["model.embed_tokens.weight"] - emb.base_layer.weight).abs().max() > 1e-3  # the adapter counts

    sent = MergedLoraWeights(model).state_dict()
    leaves = {k.split(".")[-2] for k in sent}
    assert leaves == {"embed_tokens", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"}
    for key, tensor in sent.items():
        torch.testing.assert_close(tensor, reference[key], rtol=0, atol=1e-6, msg=key)


def test_generator_copy_of_a_wrapped_model_object_is_merged_under_hf_names(llama, tmp_path):
    """A model object peft wrapped in place (peft_config with a model object, as TRL's tests pass it) is saved for
    vLLM merged under the model's names: no base_layer / lora_ names, loadable by transformers as the same policy."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfllamarl.trainers.model_io import save_for_generator

    wrapped = peft_model(llama, ["q_proj", "v_proj", "embed_tokens"])
    plain = wrapped.get_base_model()  # the user's object, now holding peft's layers
    out = save_for_generator(plain, AutoTokenizer.from_pretrained(llama), str(tmp_path / "gen"))
    saved = load_file(f"{out}/model.safetensors")
    assert not [k for k in saved if "base_layer" in k or "lora_" in k]
    assert set(saved) == set(load_file(f"{llama}/model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, wrapped(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_meta_device_adapters_get_peft_init(llama):
    """Built on the meta device and materialised, the adapters start as peft initialises them on a real model:
    linear A Kaiming-uniform (bound 1/sqrt(in)), B zero; embedding A zero, B standard normal."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfllamarl.runtime.weights.loading import build_empty, init_lora, load_shards, materialize

    targets = ["q_proj", "down_proj", "embed_tokens"]
    model = get_peft_model(build_empty(AutoConfig.from_pretrained(llama), torch.float32), LoraConfig(target_modules=targets))
    materialize(model, torch.device("cpu"))
    load_shards(model, llama)
    init_lora(model, seed=0)
    torch.manual_seed(0)
    peft_init = get_peft_model(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32),
                               LoraConfig(target_modules=targets))  # the reference: peft's own init
    ours, ref = dict(model.named_parameters()), dict(peft_init.named_parameters())
    assert set(ours) == set(ref)
    for name, p in ref.items():
        if ".lora_" not in name:
            assert torch.equal(ours[name], p), name
            continue
        q = ours[name]
        assert torch.isfinite(q).all(), name
        if ".lora_B." in name or ".lora_embedding_A." in name:
            assert not p.any() and not q.any(), name
        elif ".lora_A." in name:
            bound = 1 / math.sqrt(p.shape[1])
            assert p.abs().max() <= bound and q.abs().max() <= bound, name
            assert abs(q.std() - p.std()) < 0.15 * p.std(), name  # same law (uniform: std = bound / sqrt 3)
        else:  # lora_embedding_B
            assert abs(q.std() - 1) < 0.15 and abs(p.std() - 1) < 0.15, name


def test_adapter_files_load_with_peft(llama, tmp_path):
    """save_model's adapter files are peft's own: PeftModel.from_pretrained on the base gives the same policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.weights.checkpoint import gathered_adapters, write_adapters

    model = peft_model(llama, ["q_proj", "v_proj", "embed_tokens"]).eval()
    write_adapters(model, gathered_adapters(model), str(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32),
                                       str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_peft_inputs_accepted_and_refused(llama, tmp_path):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.weights.lora import apply_peft
    from hfllamarl.testing.tiny import build_tiny_model

    model = peft_model(llama, ["q_proj", "v_proj"])
    check_peft_inputs(model, None)  # a PeftModel alone: accepted
    with pytest.raises(ValueError, match="PeftModel as `model` together with a `peft_config`"):
        check_peft_inputs(model, LoraConfig())
    model.save_pretrained(str(tmp_path / "frozen"))
    frozen = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), str(tmp_path / "frozen"))
    with pytest.raises(ValueError, match="is_trainable=True"):
        check_peft_inputs(frozen, None)
    with pytest.raises(ValueError, match="use_dora"):
        check_peft_inputs(llama, LoraConfig(use_dora=True))
    qwen2 = build_tiny_model(str(tmp_path / "qwen2"), family="qwen2")  # tied word embeddings
    with pytest.raises(ValueError, match="tied word embeddings"):
        apply_peft(AutoModelForCausalLM.from_pretrained(qwen2), LoraConfig(target_modules=["embed_tokens", "q_proj"]))


def test_sharded_merge_equals_peft_merge(llama):
    """Two trainer ranks (FSDP2 over gloo): each merges its own rows of W (an embedding's vocabulary rows index A's
    columns); gathered, the weights equal peft's merge_and_unload() of the unsharded model."""
    import json

    from conftest import SCRIPTS, run_script, tail

    proc = run_script([str(SCRIPTS / "lora_sharded_merge.py"), llama], nproc=2, timeout=300)
    assert proc.returncode == 0, tail(proc)
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert res["sharded"]  # every sent weight was a shard of rows on each rank
    assert {k.split(".")[-2] for k in res["diffs"]} == {"embed_tokens", "q_proj", "k_proj", "v_proj", "gate_proj",
                                                         "up_proj"}
    assert all(d < 1e-6 for d in res["diffs"].values()), res["diffs"]
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert res["moved"][k] > 1e-3  # the adapters change what the generator gets
