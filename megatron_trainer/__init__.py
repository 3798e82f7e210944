"""The megatron-core trainer: megatron-core's own GPTModel, schedules, DDP and optimizer, writing the bitparity trace."""
