"""Multi-LoRA serving: many PEFT adapters over one base model in one batch (docs/lora.md)."""
