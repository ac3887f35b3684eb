"""What the port of TRL's GRPOTrainer tests shares: the two trainers, local stand-ins for TRL's Hub fixtures, the
configuration every case adds, and the parameter checks TRL's assertions make.

TRL's tests load `trl-internal-testing/zen` and tiny Hub models; here the same shapes are built locally: a Zen of
Python prompt set (17 train rows, 2 test rows, as the Hub's `standard_prompt_only` / `conversational_prompt_only`),
a tiny Qwen2 causal LM with Qwen2.5's chat template (end of turn as end of sequence, as the Hub model), and a
sequence classifier on its body as the reward model. Each case runs in the pytest process itself: TRL's trainer
and AsyncAIPOTrainer both run several jobs one after another in one process, so no case pays an interpreter and
its imports, and cases that only construct a trainer or call a pure function never start a generator.
"""

from __future__ import annotations

import os

import pytest
import torch

SIDES = ("trl", "hfllamarl")

# Lines of the Zen of Python cut mid-sentence, the shape of TRL's "zen" prompt-only set (train 17, test 2).
_ZEN = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one--",
    "Although that way may not be", "Now is better than", "Although never is often", "If the implementation",
]
_ZEN_TEST = ["Namespaces are one", "If the implementation is easy"]

# Every case adds these to TRL's configuration: TRL's tests run on a CUDA runner where bf16 is available; on this
# CPU-only machine TRL's own config refuses its bf16 default ("Your setup doesn't support bf16/gpu").
CPU = dict(bf16=False, use_cpu=True, report_to="none")


def classes(side: str):
    """(Config, Trainer) of one side: TRL's GRPOConfig/GRPOTrainer or hfllamarl's drop-in pair."""
    if side == "trl":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer

    return AsyncAIPOConfig, AsyncAIPOTrainer


def sides(ours=None):
    """pytest parameters for both trainers; `ours` (a mark or a list of marks) applies to hfllamarl only."""
    marks = [] if ours is None else (ours if isinstance(ours, list) else [ours])
    return [pytest.param("trl", id="trl"), pytest.param("hfllamarl", marks=marks, id="hfllamarl")]


def by_side(values, ours=None):
    """pytest parameters (value, side) for each value and both trainers; `ours` maps a value to hfllamarl's marks."""
    return [pytest.param(v, p.values[0], marks=p.marks, id=f"{v}-{p.id}") for v in values
            for p in sides((ours or {}).get(v))]


def xfail_ours(reason: str):
    """hfllamarl's side is known to fail for `reason` ("<area>: <what fails>"); strict, so a fix flips it."""
    return pytest.mark.xfail(strict=True, reason=reason)


def zen(config: str = "standard_prompt_only", split: str | None = "train", streaming: bool = False):
    """A local `trl-internal-testing/zen` of the same configuration, split and size; split=None gives a
    DatasetDict (or IterableDatasetDict) of both splits."""
    from datasets import Dataset, DatasetDict, IterableDatasetDict

    def rows(prompts):
        if config == "conversational_prompt_only":
            return [{"prompt": [{"role": "user", "content": p}]} for p in prompts]
        if config == "standard_prompt_only":
            return [{"prompt": p} for p in prompts]
        raise ValueError(f"no local zen configuration {config!r}")

    parts = {"train": Dataset.from_list(rows(_ZEN)), "test": Dataset.from_list(rows(_ZEN_TEST))}
    if streaming:
        parts = {k: v.to_iterable_dataset() for k, v in parts.items()}
    if split is not None:
        return parts[split]
    return (IterableDatasetDict if streaming else DatasetDict)(parts)


@pytest.fixture(scope="session")
def port_models(tmp_path_factory):
    """Local stand-ins for TRL's tiny Hub models: {"model": tiny Qwen2 with Qwen2.5's chat template
    and a context that holds TRL's default max_completion_length (512) after a prompt,
    "reward": a sequence classifier on its body, "reward_llama": one on a tiny Llama with Phi-3's chat template
    (another template and vocabulary), "qwen3": a tiny Qwen3 with Qwen3's chat template}."""
    from test_train_e2e import sequence_classifier

    from hfllamarl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("trl-port")
    model = build_tiny_model(str(root / "qwen2"), family="qwen2", chat_template="qwen2_5",
                             max_position_embeddings=1024)
    llama = build_tiny_model(str(root / "llama"), family="llama", chat_template="phi3")
    qwen3 = build_tiny_model(str(root / "qwen3"), family="qwen3", chat_template="qwen3", max_position_embeddings=1024)
    return {"model": model, "qwen3": qwen3, "reward": sequence_classifier(model, root / "reward"),
            "reward_llama": sequence_classifier(llama, root / "reward-llama")}


def make_args(Config, tmp_path, **kwargs):
    """TRL's configuration of a case plus `CPU`, writing under `tmp_path`."""
    return Config(output_dir=str(tmp_path / "out"), **CPU, **kwargs)


def whole(p: torch.Tensor) -> torch.Tensor:
    # AsyncAIPOTrainer shards the policy with FSDP2 once train() starts, so its parameters are DTensors afterwards;
    # the whole tensor is what TRL's assertion compares.
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def snapshot(trainer, trainable_only: bool = False) -> dict:
    """Parameters before training, as TRL's tests take them (`previous_trainable_params`)."""
    return {n: whole(p).detach().clone() for n, p in trainer.model.named_parameters()
            if p.requires_grad or not trainable_only}


def assert_all_changed(trainer, before: dict) -> None:
    """TRL's check after train(): every parameter has changed."""
    for n, old in before.items():
        assert not torch.equal(old, whole(trainer.model.get_parameter(n))), f"Parameter {n} has not changed."


def finish(trainer) -> None:
    """Release what a run holds (hfllamarl: its process groups, as transformers' Trainer.end())."""
    if hasattr(trainer, "end"):
        trainer.end()


def run(trainer, before: dict | None = None) -> dict:
    """train(), TRL's `train_loss` check, and (with `before`) TRL's all-parameters-changed check; returns the last
    log entry."""
    try:
        trainer.train()
        last = trainer.state.log_history[-1]
        assert last["train_loss"] is not None
        if before is not None:
            assert_all_changed(trainer, before)
        return last
    finally:
        finish(trainer)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
