"""puzzle: PPO (RLHF) training of LLaMA-class models on megatron-core, after the PUZZLE design (ATC'24)."""

__version__ = "0.1.0"
