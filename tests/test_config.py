"""AsyncAIPOConfig keeps GRPOConfig's fields and refuses what makes no sense here."""

import dataclasses

import pytest
from trl import GRPOConfig

from hfllamarl import AsyncAIPOConfig


def make(**kw):
    kw.setdefault("output_dir", "/tmp/hfllamarl-test-config")
    kw.setdefault("report_to", "none")
    return AsyncAIPOConfig(**kw)


def test_is_a_grpo_config_with_every_field():
    assert issubclass(AsyncAIPOConfig, GRPOConfig)
    ours = {f.name for f in dataclasses.fields(AsyncAIPOConfig)}
    assert {f.name for f in dataclasses.fields(GRPOConfig)} <= ours
    assert {"num_generator_processes", "generator_tensor_parallel_size", "max_staleness", "aipo_rho",
            "algorithm", "weight_sync_backend", "collective_timeout_s"} <= ours


def test_defaults_and_derived_sizes():
    c = make(per_device_train_batch_size=16, num_generations=4, gradient_accumulation_steps=2)
    assert c.algorithm == "aipo" and c.max_staleness == 1 and c.num_generator_processes == 1
    assert c.use_cpu  # no GPU here
    assert c.num_trainer_processes == 1
    assert c.completions_per_step == 32 and c.prompts_per_step == 8
    assert c.generator_tensor_parallel_size == 1


@pytest.mark.parametrize("kw,match", [
    ({"algorithm": "on_policy_pg", "num_iterations": 2}, "has no `old_logprobs` parameter in its loss"),
    ({"num_iterations": 0}, "num_iterations=0; it must be a whole number >= 1"),
    ({"learning_rate": -1e-5}, "learning_rate=-1e-05: it must be a finite number >= 0"),
    ({"learning_rate": float("nan")}, "learning_rate=nan: it must be a finite number >= 0"),
    ({"algorithm": "on_policy_pg", "top_entropy_quantile": 0.2}, "has no `entropy_mask` parameter"),
    ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile=1.5; it must be in \[0, 1\]"),
    ({"sync_ref_model": True, "beta": 0.1, "ref_model_sync_steps": 0}, "ref_model_sync_steps=0"),
    ({"sync_ref_model": True, "beta": 0.1, "ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha=1.5"),
    ({"vllm_mode": "server"}, "vllm_mode"),
    ({"steps_per_generation": 2}, "steps_per_generation"),
    ({"aipo_rho": 2.0, "vllm_importance_sampling_mode": "token_mask"}, "two different corrections"),
    ({"algorithm": "grpo", "loss_type": "vespo", "vllm_importance_sampling_mode": "sequence_mask"},
     "loss_type='vespo' needs a per-token correction"),
    ({"algorithm": "grpo", "loss_type": "vespo", "max_staleness": 0}, "loss_type='vespo' needs a per-token correction"),
    ({"algorithm": "grpo", "vllm_importance_sampling_mode": "tokens"}, "vllm_importance_sampling_mode='tokens'"),
    ({"aipo_rho": 2.0, "vllm_importance_sampling_correction": False}, "turns the weight off"),
    ({"algorithm": "on_policy_pg", "loss_type": "bnpo"}, "the .on_policy_pg. algorithm does not use it"),
    ({"sync_ref_model": True}, "sync_ref_model=True while beta=0.0"),
    ({"algorithm": "on_policy_pg", "epsilon": 0.3}, "the .on_policy_pg. algorithm does not use it"),
    ({"multi_objective_aggregation": "sum"}, "multi_objective_aggregation='sum'"),
    ({"algorithm": "grpo", "aipo_rho": 2.0}, "the .grpo. algorithm does not use it"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "num_generations must be >= 2"),
    ({"per_device_train_batch_size": 6, "num_generations": 4}, "multiple of num_generations"),
    ({"aipo_rho": 0.5}, "aipo_rho"),
    ({"aipo_rho": float("nan")}, "aipo_rho"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"max_staleness": 1.5}, "max_staleness=1.5; it must be a whole number"),
    ({"generator_tensor_parallel_size": 0.5}, "generator_tensor_parallel_size=0.5; it must be a whole number"),
    ({"beta": -0.1}, "beta"),
    ({"beta": float("nan")}, "beta"),
    ({"num_generator_processes": 0}, "num_generator_processes"),
    ({"num_generator_processes": 3, "generator_tensor_parallel_size": 2}, "multiple of"),
    ({"reward_errors": "ignore"}, "reward_errors"),
    ({"collective_timeout_s": 0}, "collective_timeout_s"),
    ({"vllm_server_timeout": 0}, "vllm_server_timeout .how long the ranks wait for each other.s start-up"),
    ({"push_to_hub": True}, "call trainer.push_to_hub"),
    ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
    ({"use_liger_kernel": True}, "Liger"),
    ({"neftune_noise_alpha": 5.0}, "NEFTune"),
    ({"save_only_model": True}, "resume is exact"),
    ({"data_seed": 3}, "prompt order follows `seed`"),
    ({"vllm_model_impl": "jax"}, "vllm_model_impl='jax'"),
    ({"dynamic_sampling_extra_prompts": 4}, "without drop_zero_variance_groups"),
    ({"drop_zero_variance_groups": True, "dynamic_sampling_extra_prompts": -1}, "whole number >= 0"),
    ({"torch_compile_mode": "max-autotune"}, "torch_compile_mode. is set, but the trainer ranks run the policy "
                                             "uncompiled"),
    ({"torch_compile_backend": "inductor"}, "torch_compile_backend"),
    ({"fsdp": "full_shard offload"}, "always shard the policy with torch FSDP2"),
    ({"fsdp_config": {"cpu_offload": True}}, "options are not read"),
    ({"optim": "adamw_torch_8bit"}, "optim='adamw_torch_8bit' is not supported"),
    ({"optim": "adafactor"}, "optim='adafactor' is not supported"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "reduce_lr_on_plateau"),
    ({"ignore_data_skip": True}, "goes on exactly where the checkpoint left the data schedule"),
    ({"enable_jit_checkpoint": True}, "one on SIGTERM is not supported"),
    ({"skip_memory_metrics": False}, "memory tracker is not run"),
    ({"save_on_each_node": True}, "shared file system"),
    ({"debug": "underflow_overflow"}, "debugging hooks are not installed"),
    ({"bf16_full_eval": True}, "in generator_dtype"),
    ({"accelerator_config": {"split_batches": True}}, "no Accelerate data loader"),
    ({"ddp_backend": "nccl"}, "ddp_backend='nccl' is not supported: the ranks talk over gloo"),
    ({"trainer_tensor_parallel_size": 0}, "trainer_tensor_parallel_size=0; it must be a whole number >= 1"),
    ({"trainer_sequence_parallel": True}, "True needs trainer_tensor_parallel_size > 1"),
    ({"trainer_fsdp_shard_size": 0}, "trainer_fsdp_shard_size=0; it must be a whole number >= 1"),
    ({"trainer_sequence_parallel": "yes", "trainer_tensor_parallel_size": 2}, "it takes True or False"),
])
def test_bad_settings_are_explained(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_epsilon_allowed_for_grpo_algorithm():
    assert make(algorithm="grpo", epsilon=0.3).epsilon == 0.3


def test_trls_loss_settings_reach_the_algorithm():
    grpo = make(algorithm="grpo", loss_type="cispo", epsilon_high=5.0, importance_sampling_level="sequence",
                vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_cap=2.5,
                off_policy_mask_threshold=0.4, mask_truncated_completions=True).build_algorithm()
    from hfllamarl.policy_loss import Correction

    o = grpo.objective
    assert (o.loss_type, o.eps_high, o.importance_sampling_level, grpo.correction, grpo.off_policy_mask_threshold) == (
        "cispo", 5.0, "sequence", Correction("token_truncate", None, 2.5), 0.4)  # TRL maps the cap to clip_max
    aipo = make(loss_type="sapo", importance_sampling_level="sequence", aipo_rho=3.0, delta=1.5,
                vespo_k_pos=1.0).build_algorithm()
    assert (aipo.loss_type, aipo.objective.importance_sampling_level, aipo.objective.delta, aipo.rho) == (
        "sapo", "sequence", 1.5, 3.0)
    assert aipo.correction == Correction("token_truncate", None, 3.0)  # AIPO's truncation at aipo_rho
    trl_mode = make(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5).build_algorithm()
    assert trl_mode.correction == Correction("token_mask", 0.5, 3.0)  # TRL's mode as TRL reads its fields
    assert make().build_algorithm().loss_type == "dapo"  # TRL's default


def test_save_strategy_epoch_and_best(tmp_path):
    from hfllamarl.trainers.trainer_ranks import save_every

    args = AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", save_strategy="epoch")
    assert save_every(args, num_batches=10, batches_per_epoch=4) == 4  # a checkpoint at the end of every epoch
    with pytest.raises(ValueError, match="save_strategy='best' saves when .* save_steps equal to eval_steps"):
        AsyncAIPOConfig(output_dir=str(tmp_path), report_to="none", save_strategy="best")


def test_ddp_timeout_is_the_collective_timeout_unless_that_is_set():
    assert make(ddp_timeout=7200).collective_timeout_s == 7200.0
    assert make(ddp_timeout=7200, collective_timeout_s=600).collective_timeout_s == 600.0
    assert make().collective_timeout_s == 1800.0


def test_generation_batch_fields_set_to_what_they_mean_here_are_accepted():
    for kw in ({"steps_per_generation": 2}, {"generation_batch_size": 16}):  # (TRL refuses both at once)
        c = make(per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2, **kw)
        assert c.completions_per_step == 16 and c.steps_per_generation == 2 and c.generation_batch_size == 16
    with pytest.raises(ValueError, match=r"`generation_batch_size`=32, but a generation batch is .* \(16 here\)"):
        make(per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2, generation_batch_size=32)


def test_every_grpo_config_field_is_read_refused_or_explained():
    """Each field of the installed TRL's GRPOConfig is in exactly one table: read somewhere in the package
    (`READ_HERE`), refused when set (`UNSUPPORTED`), or listed with why nothing here reads it (`NOT_READ_HERE`):
    a field a new TRL adds fails this test until it is placed. The tables name real fields only."""
    import re
    from pathlib import Path

    from hfllamarl.trainers.config_fields import NOT_READ_HERE, READ_HERE, UNSUPPORTED

    root = Path(__file__).resolve().parent.parent
    tables = root / "trainers" / "config_fields.py"
    source = "\n".join(p.read_text() for d in ("hfllamarl", "trainers", "plugins") for p in (root / d).rglob("*.py")
                       if p != tables)
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    placed = {"READ_HERE": set(READ_HERE), "UNSUPPORTED": set(UNSUPPORTED), "NOT_READ_HERE": set(NOT_READ_HERE)}
    not_fields = {k: sorted(v - names) for k, v in placed.items() if v - names}
    assert not not_fields, f"table entries that are not GRPOConfig fields: {not_fields}"
    twice = sorted(n for n in names if sum(n in v for v in placed.values()) > 1)
    assert not twice, f"GRPOConfig fields in more than one table of config_fields.py: {twice}"
    unplaced = sorted(names - set().union(*placed.values()))
    assert not unplaced, f"GRPOConfig fields in no table of config_fields.py (read, refused or explained): {unplaced}"
    unread = sorted(n for n in READ_HERE if not re.search(rf"\b{n}\b", source))
    assert not unread, f"listed in READ_HERE, but nothing in the package names them: {unread}"
    read_anyway = sorted(n for n in NOT_READ_HERE if re.search(rf"(args|config|self|a)\.{n}\b", source))
    assert not read_anyway, f"listed as not read, but read: {read_anyway}"


def test_empty_values_of_unset_fields_are_not_a_setting():
    make(debug=[], fsdp=[], vllm_structured_outputs_regex="")  # ("", [] and None all mean unset)


def test_shard_groups_of_several_ranks_need_a_launcher():
    """As trainer tensor parallelism: kept in one process (a recipe's check), refused by a trainer built there."""
    config = make(trainer_fsdp_shard_size=4)
    with pytest.raises(ValueError, match="trainer_fsdp_shard_size=4 shards over 4 trainer processes"):
        config.check_trainer_processes()
    make(trainer_fsdp_shard_size=1).check_trainer_processes()  # (one rank per group: what one process is)


def test_trainer_tensor_parallelism_needs_a_launcher():
    """A single process keeps the setting (a recipe meant for torchrun checks anywhere) with one data-parallel rank;
    a trainer built there refuses it, saying how to launch."""
    config = make(trainer_tensor_parallel_size=2)
    assert config.num_data_parallel_trainers == 1
    with pytest.raises(ValueError, match="needs 2 trainer processes at least, and `python script.py` runs one"):
        config.check_trainer_processes()


@pytest.mark.parametrize("family,tp,match", [
    ("qwen3_moe", 2, "mixture of experts"),
    ("llama", 4, "2 attention heads do not split evenly over 4 ranks"),
    ("mistral", 3, "4 attention heads do not split evenly over 3 ranks"),
])
def test_models_trainer_tensor_parallelism_cannot_split_are_refused(family, tp, match):
    """Before anything is built, with what to do: the plan's checks on the real families' configs (kv < tp is split
    by keeping k/v whole; MoE has no plan; heads and MLP width must divide)."""
    import transformers

    from hfllamarl.runtime.weights.tensor_parallel import TensorParallelError, check_trainer_tp
    from hfllamarl.testing.tiny import FAMILIES, _CLASSES

    config = getattr(transformers, f"{_CLASSES[family]}Config")(num_hidden_layers=2, vocab_size=64,
                                                                 **{"hidden_size": 64, "intermediate_size": 128,
                                                                    **FAMILIES[family]})
    with pytest.raises(TensorParallelError, match=match):
        check_trainer_tp(config, tp)
    check_trainer_tp(config, 1)  # FSDP2 alone runs every one of them


def test_lora_with_trainer_tensor_parallelism_is_refused():
    import transformers
    from peft import LoraConfig

    from hfllamarl.runtime.weights.tensor_parallel import TensorParallelError, check_trainer_tp

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    with pytest.raises(TensorParallelError, match="LoRA: the adapters have no tensor-parallel plan"):
        check_trainer_tp(config, 2, peft_config=LoraConfig(r=4, target_modules=["q_proj"]))


def test_use_vllm_false_written_is_warned_about_not_ignored_in_silence(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="hfllamarl"):
        AsyncAIPOConfig(output_dir="/tmp/x")  # TRL's default, not written: nothing to say
    assert "use_vllm=False" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="hfllamarl"):
        AsyncAIPOConfig(output_dir="/tmp/x", use_vllm=False)
    assert "use_vllm=False: hfllamarl always samples with vLLM" in caplog.text
