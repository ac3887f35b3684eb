"""hfllamarl: asynchronous off-policy RL fine-tuning of LLMs on the Hugging Face stack.

    from hfllamarl import AsyncAIPOTrainer, AsyncAIPOConfig, load_plugin

`import hfllamarl` stays light: the trainer, transformers and vLLM load on first use.
"""

from .registry import load_plugin

__version__ = "0.1.0"
__all__ = ["AsyncAIPOConfig", "AsyncAIPOTrainer", "load_plugin"]


def __getattr__(name):
    if name == "AsyncAIPOConfig":
        from hfllamarl.trainers.config import AsyncAIPOConfig

        return AsyncAIPOConfig
    if name == "AsyncAIPOTrainer":
        from hfllamarl.trainers.async_aipo_trainer import AsyncAIPOTrainer

        return AsyncAIPOTrainer
    raise AttributeError(f"module 'hfllamarl' has no attribute {name!r}")
