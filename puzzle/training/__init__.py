"""Model engines and per-role forward_step/loss_func callbacks in megatron's convention."""
