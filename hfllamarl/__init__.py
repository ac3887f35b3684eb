"""hfllamarl: asynchronous off-policy RL fine-tuning of LLMs on the Hugging Face stack.

    from hfllamarl import AsyncAIPOTrainer, AsyncAIPOConfig, load_plugin

`import hfllamarl` stays light: the trainer, transformers and vLLM load on first use.
"""

from .registry import load_plugin

__version__ = "0.1.0"
__all__ = ["AsyncAIPOConfig", "AsyncAIPOTrainer", "load_plugin"]


def __getattr__(name):
    if name not in ("AsyncAIPOConfig", "AsyncAIPOTrainer"):
        raise AttributeError(f"module 'hfllamarl' has no attribute {name!r}")
    from .runtime.world.collector import collector_paused

    # The first of these imports torch, transformers, peft and trl (the collector's pause saves about 0.4 s of the
    # 4.7 s); nothing of the user's process is frozen, and the collector is left as it was.
    with collector_paused(freeze=False):
        if name == "AsyncAIPOConfig":
            from hfllamarl.trainers.config import AsyncAIPOConfig

            return AsyncAIPOConfig
        from hfllamarl.trainers.async_aipo_trainer import AsyncAIPOTrainer

        return AsyncAIPOTrainer
