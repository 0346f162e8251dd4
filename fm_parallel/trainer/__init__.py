"""The long-context LoRA trainer (SFT and DPO on packed data): config, data, losses, loop."""
