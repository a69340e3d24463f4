"""Rollout: autoregressive generation from the actor (KV cache, vocab-parallel sampling,
pipelined inference scheduling)."""

from puzzle.rollout.generation import GenerationOutput, generate
from puzzle.rollout.sampling import SamplingParams, sample_tokens

__all__ = ["GenerationOutput", "SamplingParams", "generate", "sample_tokens"]
