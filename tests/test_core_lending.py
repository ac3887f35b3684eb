"""Core lending: once every generator child has finished the trainer's tick, the trainer's next layer runs on every
core, and the cores go back at the end of its step (checked against the OS's own affinity and torch's threads)."""

import os

import pytest
import torch

from hfllamarl.runtime.world.core_lending import CoreBoard, CoreLender

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs two cores")


@pytest.fixture
def restore():
    threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cpus)


def test_the_trainer_borrows_only_after_every_generator_finished_its_tick_and_gives_back(tmp_path, restore):
    from transformers import LlamaConfig, LlamaForCausalLM

    board = CoreBoard(str(tmp_path / "board"), num_generators=2, create=True)
    child_view = CoreBoard(str(tmp_path / "board"), num_generators=2)  # what a generator child opens
    lender = CoreLender(board, own_cpus=CPUS[:1], all_cpus=CPUS)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    seen = []
    model.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append((torch.get_num_threads(),
                                                                               os.sched_getaffinity(0))))
    lender.install(model)
    os.sched_setaffinity(0, CPUS[:1])
    torch.set_num_threads(1)

    with lender.lending(tick=3):
        child_view.finished(0, 3)  # one generator of two is done: nothing to borrow yet
        model(torch.tensor([[1, 2, 3]]))
        assert seen[-1] == (1, {CPUS[0]}) and not lender.borrowed
        child_view.finished(1, 2)  # the other is still on tick 3 (it finished tick 2)
        model(torch.tensor([[1, 2, 3]]))
        assert seen[-1] == (1, {CPUS[0]})
        child_view.finished(1, 3)
        model(torch.tensor([[1, 2, 3]]))
        assert seen[-1] == (len(CPUS), set(CPUS)) and lender.borrowed
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {CPUS[0]}

    # Found in the backward pass: the generators finish while the trainer is between its forward and backward.
    with lender.lending(tick=4):
        loss = model(torch.tensor([[1, 2, 3]])).logits.sum()
        assert not lender.borrowed
        child_view.finished(0, 4), child_view.finished(1, 4)
        threads_in_backward = []
        model.model.layers[0].self_attn.q_proj.weight.register_hook(lambda g: threads_in_backward.append(
            torch.get_num_threads()))
        loss.backward()
        assert lender.borrowed and threads_in_backward == [len(CPUS)]
    lender.close()
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {CPUS[0]}


@pytest.mark.slow
def test_after_train_the_process_has_its_cores_and_threads_back(tiny_model, tmp_path, restore):
    """A single-process job pins its trainer (this process) to cores of its own while it trains; once train()
    returns, the process (a notebook's) runs on the cores and torch threads it had before, as seen by the OS."""
    from datasets import Dataset

    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer

    before = (os.sched_getaffinity(0), torch.get_num_threads())
    args = AsyncAIPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=2,
                           per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    trainer = AsyncAIPOTrainer(model=tiny_model, args=args,
                               reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                               train_dataset=Dataset.from_list([{"prompt": f"{i} + 1 ="} for i in range(8)]))
    trainer.train()
    assert trainer.state.global_step == 2
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
