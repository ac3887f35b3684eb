"""TRL-compatible front-ends: `AsyncAIPOTrainer` and `AsyncAIPOConfig`."""

from .async_aipo_trainer import AsyncAIPOTrainer
from .config import AsyncAIPOConfig

__all__ = ["AsyncAIPOConfig", "AsyncAIPOTrainer"]
