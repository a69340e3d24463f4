"""Model engines: a role's megatron model with its DDP wrapper, optimizer, scheduler and layout
(model_engine.py), vocab-parallel log-probs, the NaN/inf policy, optimizer offloading and MoE metrics."""
