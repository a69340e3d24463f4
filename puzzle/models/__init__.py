"""Role models (actor, ref, critic, reward) on megatron-core GPTModel."""
