"""Add-ons built on the core: offload homes and OffloadModel, activation checkpointing,
compiled blocks, ``summon_full_params``, state dicts, saving and loading checkpoints,
Hugging Face files, the grad scaler, and the memory planner (``planner/``)."""
