"""Autoregressive generation from an actor at any (P, D, T) with megatron-core's KV cache.

``generate`` is called on every rank of the actor's layout with this DP rank's prompts. Prompts
are left-padded; each row gets its own position ids (0 at its first real token, also for RoPE)
and its padded keys are masked, so a padded prompt continues exactly like the prompt alone.

Model calls. Each micro-batch owns a ``StaticInferenceContext`` (megatron's KV cache): one
prefill call over the prompt, then one-token decode calls. Two forward hooks, installed only for
the duration of ``generate``, adapt GPTModel's unmodified forward:

- ``output_layer`` pre-hook: GPTModel._postprocess asserts ``runtime_gather_output`` in
  inference mode ("Inference must always gather TP logits"). We pass ``True`` to satisfy the
  assertion and the hook rewrites the output layer's own ``runtime_gather_output`` to ``False``,
  so the last stage returns vocab-parallel logits [b, 1, V/T] (only the last position is
  materialised by the static context) and the vocabulary is never gathered.
- ``rotary_pos_emb`` forward hook: GPTModel computes RoPE for slot indices 0..S-1 shared by all
  rows and ignores ``position_ids``; the hook re-indexes the table per row ([S, b, 1, d]) with the
  row's position ids, which megatron's unfused RoPE broadcasts over the batch.

Scheduling (``puzzle/rollout/schedule.py``): with P > 1 the micro-batches circulate through the
stages (hybrid pipelined inference); sampled tokens go from the last stage to every other
stage, so every rank of the model replica ends with the same output. Finished rows are dropped
from the decode batch (their KV-cache rows too) and a micro-batch stops when all of its rows
have finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from puzzle.rollout.sampling import SamplingParams


@dataclass
class GenerationOutput:
    """Prompts left-padded to the longest prompt Lp, responses right-padded after EOS.

    All tensors have ``b`` rows; the [b, Lp + max_new] masks are int64 0/1.
    """

    tokens: torch.Tensor            # [b, Lp + max_new]
    attention_mask: torch.Tensor    # [b, Lp + max_new] prompt_mask | response_mask
    prompt_mask: torch.Tensor       # [b, Lp + max_new] 1 on real prompt tokens
    response_mask: torch.Tensor     # [b, Lp + max_new] 1 on generated tokens up to and incl. EOS
    prompt_lengths: torch.Tensor    # [b]
    response_lengths: torch.Tensor  # [b]
    prompt_length: int = 0          # Lp: the column where responses start
    forward_passes: int = 0         # model calls run by this rank (all micro-batches)

    def responses(self) -> List[List[int]]:
        """The generated tokens of every row (up to and including EOS)."""
        lp = self.prompt_length
        return [self.tokens[i, lp:lp + int(n)].tolist() for i, n in enumerate(self.response_lengths)]


class MicroBatch:
    """Rows of one micro-batch, their KV cache and their generation state (same on all stages)."""

    def __init__(self, rows: List[int], prompts: List[List[int]], max_new: int, stop_ids,
                 device: torch.device):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.device = device
        lens = torch.tensor([len(prompts[r]) for r in rows], dtype=torch.long)
        self.lm = int(lens.max())
        self.max_new, self.stop_ids = max_new, torch.tensor(list(stop_ids), dtype=torch.long, device=device)
        n, width = len(rows), self.lm + max_new
        pad = self.lm - lens
        ids = torch.zeros(n, self.lm, dtype=torch.long)  # id 0 under the (masked) padding
        for i, r in enumerate(rows):
            ids[i, int(pad[i]):] = torch.tensor(prompts[r], dtype=torch.long)
        slots = torch.arange(width).unsqueeze(0)
        # every tensor that meets the model or the sampler lives on the model's device
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.ids = ids.to(device)
        self.positions = (slots - pad.unsqueeze(1)).clamp(min=0).to(device)  # [n, width]
        self.key_pad = (slots < pad.unsqueeze(1)).to(device)                 # [n, width] True = pad
        self.ctx = StaticInferenceContext(max_batch_size=n, max_sequence_length=width)
        self.active = torch.arange(n, device=device)  # rows (of this micro-batch) still generating
        self.out = torch.zeros(n, max_new, dtype=torch.long, device=device)
        self.resp_len = torch.zeros(n, dtype=torch.long, device=device)
        self.last: Optional[torch.Tensor] = None  # tokens sampled at the previous step (active rows)
        self.step = 0                           # number of tokens generated so far
        self.done = False

    # -- model inputs of the next call -------------------------------------------------------
    def seq_len(self) -> int:
        return self.lm if self.step == 0 else 1

    def inputs(self):
        """(input_ids [na, s], position_ids [na, s], attention_mask [na, 1, s, k] True = masked)."""
        a = self.active
        if self.step == 0:
            s = self.lm
            causal = torch.ones(s, s, dtype=torch.bool, device=self.device).triu(1)
            mask = causal.unsqueeze(0) | self.key_pad[a, None, :s]
            self.ctx.sequence_len_offset = 0
            self.ctx.enable_prefill_mode()
            return self.ids[a], self.positions[a, :s], mask.unsqueeze(1)
        k = self.lm + self.step
        self.ctx.sequence_len_offset = k - 1
        self.ctx.enable_decode_mode()
        return (self.last.unsqueeze(1), self.positions[a, k - 1:k],
                self.key_pad[a, None, None, :k])

    def sample_ids(self, offset: int) -> torch.Tensor:
        return offset + self.rows[self.active]

    # -- state update after a step (run on every stage with the same tokens) -----------------
    def advance(self, tok: torch.Tensor) -> None:
        a = self.active
        self.out[a, self.step] = tok
        self.resp_len[a] = self.step + 1
        self.step += 1
        if self.step >= self.max_new:
            return self._finish()
        keep = ~torch.isin(tok, self.stop_ids)
        if not bool(keep.any()):
            return self._finish()
        if not bool(keep.all()):
            idx = keep.nonzero().squeeze(1)
            for layer, (k, v) in list(self.ctx.key_value_memory_dict.items()):
                self.ctx.key_value_memory_dict[layer] = (k[:, idx], v[:, idx])
            self.active = a[idx]
            tok = tok[idx]
        self.last = tok

    def _finish(self) -> None:
        self.done = True
        self.active = self.active[:0]
        self.ctx = None  # frees this micro-batch's KV cache
        self.last = None


class _Hooks:
    """Forward hooks that adapt GPTModel.forward to generation (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        self.positions: Optional[torch.Tensor] = None  # [na, S] of the micro-batch being run
        self._handles = []

    def __enter__(self):
        m = self.model
        if getattr(m, "post_process", False) and getattr(m, "output_layer", None) is not None:
            self._handles.append(m.output_layer.register_forward_pre_hook(
                self._no_gather, with_kwargs=True))
        rope = getattr(m, "rotary_pos_emb", None)
        if rope is not None and getattr(m, "position_embedding_type", None) == "rope":
            self._handles.append(rope.register_forward_hook(self._per_row_rope))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.positions = None
        return False

    @staticmethod
    def _no_gather(module, args, kwargs):
        kwargs["runtime_gather_output"] = False
        return args, kwargs

    def _per_row_rope(self, module, args, emb):
        if self.positions is None:
            return emb
        if emb.dim() != 4 or emb.shape[1] != 1 or emb.shape[0] < self.positions.shape[1]:
            raise RuntimeError(f"unexpected RoPE table shape {tuple(emb.shape)}")
        return emb[:, 0][self.positions.t()]  # [S, 1, d] -> [S, na, 1, d]


class Stepper:
    """Runs one model call of a micro-batch on this stage."""

    def __init__(self, engine, hooks: _Hooks):
        self.model, self.hooks = engine.module, hooks
        self.layout = engine.layout
        self.config = engine.config
        self.forward_passes = 0

    def __call__(self, mb: MicroBatch, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """Stage input (None on the first stage) -> hidden states [s, na, h] or logits [na, V/T]."""
        ids, pos, mask = mb.inputs()
        self.hooks.positions = mb.positions[mb.active]
        if not self.layout.is_first_stage:
            self.model.set_input_tensor(hidden)
        try:
            out = self.model(ids, pos, mask, inference_context=mb.ctx, runtime_gather_output=True)
        finally:
            self.hooks.positions = None
            if not self.layout.is_first_stage:
                self.model.set_input_tensor(None)
        self.forward_passes += 1
        if self.layout.is_last_stage:
            return out[:, -1, :]  # [na, V/T]
        return out.contiguous()


def _check_prompts(prompts, vocab: int) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids")
        bad = [t for t in p if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")


def generate(engine, prompts: List[List[int]], params: SamplingParams, seed: int,
             micro_batch_size: Optional[int] = None, *, sample_offset: int = 0) -> GenerationOutput:
    """Generate continuations of this DP rank's ``prompts`` with the actor ``engine``.

    Call on every rank of the engine's layout, with the same prompts on all TP/PP ranks of one
    DP group. ``sample_offset`` is the index of the first prompt in the global batch (so DP
    splits do not change sampled tokens). ``micro_batch_size`` defaults to the whole batch at
    P=1 and ceil(b / P) at P>1. Returns the same GenerationOutput on every rank of the replica.
    """
    from puzzle.rollout.schedule import run_schedule

    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams (got {type(params).__name__})")
    if engine.module is None:
        raise ValueError(f"rank {engine.layout.rank} is not in the {engine.role} layout "
                         f"{engine.layout.plan}; only its ranks call generate")
    arch = engine.arch
    _check_prompts(prompts, arch.vocab_size)
    if any(i >= arch.vocab_size for i in params.stop_ids):
        raise ValueError(f"eos_id/eos_ids {params.stop_ids} are outside the vocabulary ({arch.vocab_size})")
    if not isinstance(sample_offset, int) or sample_offset < 0:
        raise ValueError(f"sample_offset must be an int >= 0 (got {sample_offset!r})")
    b = len(prompts)
    lp = max(len(p) for p in prompts)
    width = lp + params.max_new_tokens
    if width > arch.max_position_embeddings:
        raise ValueError(f"longest prompt ({lp}) + max_new_tokens ({params.max_new_tokens}) = "
                         f"{width} exceeds max_position_embeddings={arch.max_position_embeddings}")
    P = engine.layout.plan.P
    mbs = micro_batch_size if micro_batch_size is not None else math.ceil(b / P)
    if not isinstance(mbs, int) or mbs < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1 (got {micro_batch_size!r})")

    model = engine.module
    was_training = model.training
    model.eval()
    # megatron runs inference without sequence parallelism (a decode step has one position)
    sequence_parallel = bool(model.config.sequence_parallel)
    if sequence_parallel:
        from megatron.core.transformer.utils import set_model_to_sequence_parallel

        set_model_to_sequence_parallel(model, False)
    device = model.puzzle_device
    mbatches = [MicroBatch(list(range(i, min(i + mbs, b))), prompts, params.max_new_tokens,
                           params.stop_ids, device) for i in range(0, b, mbs)]
    try:
        with torch.no_grad(), _Hooks(model) as hooks:
            stepper = Stepper(engine, hooks)
            run_schedule(engine, mbatches, stepper, params, seed, sample_offset)
    finally:
        for mb in mbatches:
            mb.ctx = None  # drop every KV cache, also on error
        model.train(was_training)
        if sequence_parallel:
            set_model_to_sequence_parallel(model, True)
    return _assemble(prompts, mbatches, params, lp, stepper.forward_passes)


def _assemble(prompts, mbatches: List[MicroBatch], params: SamplingParams, lp: int,
              forward_passes: int) -> GenerationOutput:
    b, n_new = len(prompts), params.max_new_tokens
    tokens = torch.full((b, lp + n_new), params.pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(b, lp + n_new, dtype=torch.long)
    response_mask = torch.zeros_like(prompt_mask)
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    rlen = torch.zeros(b, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, lp - len(p):lp] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, lp - len(p):lp] = 1
    for mb in mbatches:
        out, resp_len = mb.out.cpu(), mb.resp_len.tolist()
        for j, r in enumerate(mb.rows.tolist()):
            n = resp_len[j]
            rlen[r] = n
            tokens[r, lp:lp + n] = out[j, :n]
            response_mask[r, lp:lp + n] = 1
    out = GenerationOutput(tokens=tokens, attention_mask=prompt_mask | response_mask,
                           prompt_mask=prompt_mask, response_mask=response_mask,
                           prompt_lengths=plen, response_lengths=rlen,
                           prompt_length=lp, forward_passes=forward_passes)
    return out
