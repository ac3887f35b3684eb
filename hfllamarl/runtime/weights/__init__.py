"""Where the policy's tensors live: FSDP2 shards (fsdp), loading from a path or the Hub (loading), LoRA
merging (lora), safetensors export (hf_export), checkpoints (checkpoint) and power-cut-safe files (durable).
Imports `world` and `loop`."""
