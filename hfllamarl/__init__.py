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
    import gc

    # The first of these imports torch, transformers, peft and trl: millions of objects that outlive the import,
    # which Python's cyclic collector would walk again and again meanwhile (about 0.7 s of the 5 s on a CPU core).
    # The collector is paused for the import only, and left as it was.
    enabled = gc.isenabled()
    gc.disable()
    try:
        if name == "AsyncAIPOConfig":
            from hfllamarl.trainers.config import AsyncAIPOConfig

            return AsyncAIPOConfig
        from hfllamarl.trainers.async_aipo_trainer import AsyncAIPOTrainer

        return AsyncAIPOTrainer
    finally:
        if enabled:
            gc.enable()
