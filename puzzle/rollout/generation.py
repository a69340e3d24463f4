"""Autoregressive generation from an actor at any (P, D, T), with a static in-place KV cache.

``generate`` is called on every rank of the actor's layout with this DP rank's prompts. The
output is in response coordinates, the form the rollout batch stores per-token quantities in:
``response_tokens`` [b, max_new] and ``logprobs`` [b, max_new], row b's response (up to and
including EOS) in its first ``response_lengths[b]`` columns, pad after it. Prompts are not copied
into it: the caller has them.

Decode loop. Prompts are sorted by length (longest first, ties in row order) and served through
static KV caches (puzzle/models/sdpa_attention.py ``StaticKVCache``) of ``slots`` rows. Every row
has its own length: a prompt occupies cache positions 0..len-1 and its RoPE positions are its
own; its keys are written in place, never concatenated. A model call is either

- a prefill of new prompts into free slots (packed into one sequence without padding, each
  prompt with causal attention over its own keys; the logits are read at each prompt's last
  token), or
- a decode step: one token for each of the slots 0..n-1 (n = 1 + the highest active slot),
  attending to the row's positions <= its own.

At P=1 one cache of ``micro_batch_size`` slots serves all of the rank's prompts: a finished row's
slot is refilled with the next waiting prompt (continuous batching), so no row waits for the
longest one of a fixed micro-batch. At P>1 the micro-batches are consecutive length buckets of
the sorted prompts, each with its own cache, pipelined through the stages
(puzzle/rollout/pipelined_generation.py); a micro-batch runs until its rows have finished.

Model calls run megatron-core's GPTModel forward with ``inference_context=None``: the
core-attention modules (any --attention-backend) read and write the bound cache, and two hooks
installed only for the duration of ``generate`` adapt it (a decode step of a local-spec model
runs the same arithmetic through puzzle/models/decode_layer.py ``decode_forward``, without
megatron's per-call plumbing):

- ``rotary_pos_emb`` forward hook: the RoPE table is computed once per generation; decode steps
  index it with each row's position;
- ``output_layer`` pre-hook: in a prefill, only each prompt's last position goes through the
  output layer. Logits stay vocab-parallel ([n, V/T]); the vocabulary is never gathered.

Tokens depend only on (seed, global sample index, step, logits) (puzzle/rollout/sampling.py),
so they are the same at every layout, micro-batch size and order of service. With each token its
log-prob under the logits it was sampled from is recorded (``GenerationOutput.logprobs``), on
every path: scoring compares its own with it (the generation-vs-scoring log-prob difference). With
``cuda_graphs`` (GPU, P=1) decode steps replay CUDA graphs captured per batch-size bucket
(puzzle/rollout/cuda_graphs.py). With ``batch_invariant`` (--batch-invariant-mode) every call runs
in puzzle/models/batch_invariant.py's mode, whose arithmetic scoring repeats bit for bit: the
difference is then 0.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from puzzle.models.batch_invariant import batch_invariant_mode
from puzzle.rollout.partial import GroupQuota, check_resume, check_sample_ids
from puzzle.rollout.sampling import SamplingParams
from puzzle.rollout.turns import TurnHandler, TurnResume, TurnTracker


@dataclass
class GenerationOutput:
    """This rank's responses in response coordinates (``b`` rows, ``max_new`` columns)."""

    response_tokens: torch.Tensor   # [b, max_new] long: the response, then pad_id
    response_lengths: torch.Tensor  # [b] long: generated tokens up to and including EOS
    prompt_lengths: torch.Tensor    # [b] long
    forward_passes: int = 0         # model calls run by this rank (all micro-batches)
    # [b, max_new] float32: log-prob of each generated token as it was sampled (sampling.py
    # ``sampled_logprobs``: temperature-scaled, unfiltered, scoring's function); 0 after the response
    logprobs: Optional[torch.Tensor] = None
    # [b] bool: the row ended (a stop id or max_new_tokens); False only for rows left running
    # when ``stop`` ended the generation (their tokens so far are in the first columns)
    finished: Optional[torch.Tensor] = None
    # multi-turn (``turns``): [b, max_new] bool, True at the observation tokens an environment
    # inserted (on the host), and the counts of turns, observation tokens and cut samples (and
    # ``step_wait_seconds``: the decode loop's time waiting for environment steps at the joins)
    observation_mask: Optional[torch.Tensor] = None
    turn_counts: Optional[dict] = None
    turn_states: Optional[List[TurnResume]] = None  # multi-turn: each row's turn bookkeeping at the end

    def responses(self) -> List[List[int]]:
        """The generated tokens of every row (up to and including EOS)."""
        tokens = self.response_tokens.tolist()  # one read from the device
        return [row[:n] for row, n in zip(tokens, self.response_lengths.tolist())]


def service_order(prompts: List[List[int]]) -> List[int]:
    """Row indices, longest prompt first (ties in row order): the length buckets."""
    return sorted(range(len(prompts)), key=lambda r: (-len(prompts[r]), r))


@dataclass
class Call:
    """One model call of a SlotBatch (the same on every stage of the replica)."""

    prefill: bool
    n: int                       # batch rows of the call (prefill: 1, the packed prompts)
    seq_len: int
    ids: torch.Tensor            # [n, seq_len]
    positions: torch.Tensor      # [n, seq_len]
    slots: torch.Tensor          # prefill: the slots filled; decode: the active slots sampled
    last: Optional[torch.Tensor] = None  # prefill: each prompt's last position in the packing
    dense: bool = False          # decode: the sampled slots are exactly 0..n-1


class SlotBatch:
    """Prompts ``order`` served through one static KV cache of ``slots`` rows."""

    def __init__(self, order: List[int], prompts: List[List[int]], params: SamplingParams,
                 slots: int, results: "Results", device, cache=None, resumed: Optional[List[List[int]]] = None):
        from puzzle.models.sdpa_attention import StaticKVCache

        self.prompts, self.queue = prompts, deque(order)
        self.resumed = resumed  # per row: the partial response a prefill continues (or None)
        self.max_new = params.max_new_tokens
        self.stop_ids = torch.tensor(list(params.stop_ids), dtype=torch.long, device=device)
        self.slots, self.results, self.device = slots, results, device
        width = max(len(prompts[r]) for r in order) + self.max_new
        self.cache = cache if cache is not None else StaticKVCache(slots, width)
        z = dict(dtype=torch.long, device=device)
        self.row = torch.zeros(slots, **z)     # global row served by each slot
        self.lens = torch.zeros(slots, **z)    # tokens in the cache per slot
        self.count = torch.zeros(slots, **z)   # tokens generated per slot (= step of the next)
        self.last = torch.zeros(slots, **z)    # last sampled token per slot (next decode input)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.all_slots = torch.arange(slots, **z)
        # host copies of what decides the next call, so that planning it reads nothing back
        # from the device (only an EOS check does, once per call, when stop ids are set)
        self.host_lens = [0] * slots
        self.host_count = [0] * slots
        self.host_active: List[int] = []       # slots generating, ascending
        self.host_row = [0] * slots            # host copy of self.row
        self.finished_rows: List[int] = []     # rows finished by the last advance
        self.free = list(range(slots))         # free slots, ascending
        self.call: Optional[Call] = None
        self.call_slots: List[int] = []        # host copy of call.slots
        self.done = False
        self.turns: Optional[TurnTracker] = None  # multi-turn rows (puzzle/rollout/turns.py)
        self.paused: List[int] = []            # multi-turn: slots whose row waits for its step
        self.appends: List[tuple] = []         # multi-turn: (slot, tokens) the next prefill appends
        self.clock = 0                         # multi-turn: model calls run (the joins' clock)

    # -- the next model call -----------------------------------------------------------------
    def next_call(self) -> Call:
        if (self.queue and self.free) or self.appends:
            self.call = self._prefill_call()
        else:
            act = self.host_active
            n = act[-1] + 1
            pos = self.lens[:n]
            self.cache.decode(n, pos, max(self.host_lens[:n]) + 1)
            dense = len(act) == n  # every slot 0..n-1 samples: no gather of their logits
            slots = self.all_slots[:n] if dense else torch.tensor(act, dtype=torch.long,
                                                                   device=self.device)
            self.call = Call(False, n, 1, self.last[:n].unsqueeze(1), pos.unsqueeze(1), slots,
                             dense=dense)
            self.call_slots = list(act)
        return self.call

    def _prefill_call(self) -> Call:
        """New prompts into free slots, packed after the segments appended to kept rows (a
        multi-turn row's last sampled token and its observation, at the slot's length)."""
        k = min(len(self.free), len(self.queue))
        slots, self.free = self.free[:k], self.free[k:]
        rows = [self.queue.popleft() for _ in range(k)]
        seqs = [self.prefill_tokens(r) for r in rows]
        done = [len(q) - len(self.prompts[r]) for r, q in zip(rows, seqs)]  # tokens resumed
        lens = [len(q) for q in seqs]
        z = dict(dtype=torch.long, device=self.device)
        if k:
            slots_t = torch.tensor(slots, **z)
            self.row[slots_t] = torch.tensor(rows, **z)
            self.lens[slots_t] = torch.tensor(lens, **z)
            self.count[slots_t] = torch.tensor(done, **z)
        for s, n, c, r in zip(slots, lens, done, rows):
            self.host_lens[s], self.host_count[s], self.host_row[s] = n, c, r
        appends, self.appends = self.appends, []
        starts = [self.host_lens[s] for s, _ in appends] + [0] * k
        seqs = [q for _, q in appends] + seqs
        slots = [s for s, _ in appends] + slots
        sizes = [len(q) for q in seqs]
        if appends:
            a_slots = torch.tensor([s for s, _ in appends], **z)
            a_lens = [b + len(q) for b, (_, q) in zip(starts, appends)]
            self.lens[a_slots] = torch.tensor(a_lens, **z)
            for (s, _), n in zip(appends, a_lens):
                self.host_lens[s] = n
        packed = [t for q in seqs for t in q]
        ids = torch.tensor([packed], **z)  # [1, T]
        self.call_slots = slots
        self.cache.prefill(slots, sizes, self.device, starts)
        pos = self.cache.pos.unsqueeze(0)
        return Call(True, 1, len(packed), ids, pos, torch.tensor(slots, **z),
                    torch.tensor(sizes, **z).cumsum(0) - 1)

    def prefill_tokens(self, r: int) -> List[int]:
        """Row r's prefill: its prompt, then the partial response it resumes (if any)."""
        if self.resumed is None or not self.resumed[r]:
            return self.prompts[r]
        return list(self.prompts[r]) + list(self.resumed[r])

    def sample_ids(self) -> torch.Tensor:
        """The global sample index of each row this call samples."""
        call = self.call
        return self.results.sample_ids[self.row[:call.n] if call.dense else self.row[call.slots]]

    def steps(self) -> torch.Tensor:
        call = self.call
        return self.count[:call.n] if call.dense else self.count[call.slots]

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """The logit rows of the slots this call samples ([n, V/T] -> [m, V/T])."""
        return logits if self.call.prefill or self.call.dense else logits[self.call.slots]

    # -- state update after a call (run on every stage with the same tokens) -----------------
    def advance(self, tok: torch.Tensor, logprob: torch.Tensor) -> None:
        call, sl, slots = self.call, self.call.slots, self.call_slots
        if call.prefill:
            self.active[sl] = True
            self.host_active = sorted(self.host_active + slots)
        else:
            self.lens[sl] += 1
            for s in slots:
                self.host_lens[s] += 1
        if self.turns is not None:
            self.turns.record([self.host_row[s] for s in slots], tok)
        rows, step = self.row[sl], self.count[sl]
        self.results.out[rows, step] = tok
        self.results.logprobs[rows, step] = logprob
        self.count[sl] = step + 1
        self.results.resp_len[rows] = step + 1
        self.last[sl] = tok
        for s in slots:
            self.host_count[s] += 1
        fin = [self.host_count[s] >= self.max_new for s in slots]
        if self.stop_ids.numel():
            fin = [f or e for f, e in zip(fin, torch.isin(tok, self.stop_ids).tolist())]
        paused = []
        if self.turns is not None:
            self.clock += 1
            status = self.turns.end_turns([self.host_row[s] for s in slots], fin, self.clock)
            fin = [st == "end" for st in status]
            paused = [s for s, st in zip(slots, status) if st == "pause"]
        gone = [s for s, f in zip(slots, fin) if f]
        self.finished_rows = [self.host_row[s] for s in gone]
        if gone or paused:  # out of the decode calls; a paused row keeps its slot and cache
            self.active[torch.tensor(gone + paused, dtype=torch.long, device=self.device)] = False
            self.host_active = [s for s in self.host_active if s not in gone and s not in paused]
            self.free = sorted(self.free + gone)
            self.paused += paused
        if self.paused:
            self._join_turns()
        self.call = None
        self.done = not self.queue and not self.host_active and not self.paused and not self.appends

    def _join_turns(self) -> None:
        """The paused rows whose steps are due at the clock joined: their observations written
        into the results and queued for the next prefill, or their slots freed; when no row
        could run the next call, the clock jumps to the next join."""
        while True:
            joined = self.turns.join(self.clock)
            if joined:
                self._resume(joined)
            if not self.paused or self.host_active or self.appends or (self.queue and self.free):
                return
            due = self.turns.next_due()
            if due is None:
                raise RuntimeError("multi-turn generation: rows are paused but no step is in flight")
            self.clock = max(self.clock, due)

    def _resume(self, joined) -> None:
        slot_of = {self.host_row[s]: s for s in self.paused}
        rows, cols, vals, ends = [], [], [], []
        for r, obs, goes_on in joined:
            s = slot_of[r]
            self.paused.remove(s)
            n = self.host_count[s]
            rows += [r] * len(obs)
            cols += range(n, n + len(obs))
            vals += obs
            ends.append((r, n + len(obs)))
            if goes_on:  # the turn's last sampled token (not yet in the cache), then the observation
                self.appends.append((s, [self.turns.tokens[r][n - 1]] + list(obs)))
                self.host_count[s] = n + len(obs)
            else:
                self.free = sorted(self.free + [s])
                self.finished_rows.append(r)
        z = dict(dtype=torch.long, device=self.device)
        if vals:
            self.results.out[torch.tensor(rows, **z), torch.tensor(cols, **z)] = torch.tensor(vals, **z)
        row_t = torch.tensor([r for r, _ in ends], **z)
        self.results.resp_len[row_t] = torch.tensor([n for _, n in ends], **z)
        going = [(s, self.host_count[s]) for s, _ in self.appends]
        if going:
            self.count[torch.tensor([s for s, _ in going], **z)] = torch.tensor([c for _, c in going], **z)

    def flush_turns(self) -> List[int]:
        """The end of the loop (a quota stop, or every row ended): every step still in flight
        joined (``TurnTracker.flush``), the observations written into the rows' responses, and the
        rows left running: queued, decoding, or with an observation written and not yet prefilled
        (a row the observation ends, its episode done or its budget spent, has finished)."""
        joined = self.turns.flush()
        if joined:
            self._resume(joined)
        return list(self.queue) + [self.host_row[s] for s in self.host_active + [s for s, _ in self.appends]]

    def sync_host(self) -> None:
        """Host copies from the device state (after steps that updated it on the device)."""
        self.host_lens, self.host_count = self.lens.tolist(), self.count.tolist()
        self.host_active = [i for i, a in enumerate(self.active.tolist()) if a]
        self.host_row = self.row.tolist()


@dataclass
class Results:
    out: torch.Tensor       # [b, max_new]
    resp_len: torch.Tensor  # [b]
    logprobs: torch.Tensor  # [b, max_new] float32: each sampled token's log-prob
    sample_ids: Optional[torch.Tensor] = None  # [b] long: each row's global sample index (noise key)

    @classmethod
    def empty(cls, rows: int, max_new: int, sample_ids: List[int], device) -> "Results":
        return cls(torch.zeros(rows, max_new, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(rows, max_new, dtype=torch.float32, device=device),
                   torch.tensor(sample_ids, dtype=torch.long, device=device))


class _Hooks:
    """Cache binding and forward hooks that adapt GPTModel.forward to generation."""

    def __init__(self, model, width: int):
        from puzzle.models.sdpa_attention import KVCacheMixin

        self.model = model
        self.attention = [m for m in model.modules() if isinstance(m, KVCacheMixin)]
        if not self.attention:
            raise ValueError("generation needs a KV-cache core attention in every layer "
                             "(build the model with puzzle.models.builders)")
        self.width = width
        self._rope = None                              # the model's own RotaryEmbedding
        self.cache = None                              # the bound StaticKVCache
        self.cos = self.sin = None                     # RoPE tables [width, 1, d]
        self.last: Optional[torch.Tensor] = None       # prefill: [n] last prompt positions
        self._handles = []

    def __enter__(self):
        m = self.model
        if getattr(m, "post_process", False) and getattr(m, "output_layer", None) is not None:
            self._handles.append(m.output_layer.register_forward_pre_hook(self._last_tokens))
        rope = getattr(m, "rotary_pos_emb", None)
        if rope is not None and getattr(m, "position_embedding_type", None) == "rope":
            if type(rope).__name__ != "RotaryEmbedding" or m.config.rotary_interleaved \
                    or getattr(rope, "rotary_percent", 1.0) != 1.0:
                raise ValueError(f"generation supports plain RoPE only (got {type(rope).__name__})")
            table = rope(self.width)[:, 0]  # [width, 1, d], once per generation
            self.cos, self.sin = torch.cos(table) * 1.0, torch.sin(table) * 1.0
            m.rotary_pos_emb = _NoRope(rope)
            self._rope = rope
        return self

    def rope(self, positions: torch.Tensor, prefill: bool) -> None:
        """The call's cos/sin at ``positions`` [n, s]: prefill [1, T] (the packed prompts'
        positions) -> [T, 1, 1, d]; decode [n, 1] -> [1, n, 1, d]."""
        cache = self.cache
        if self.cos is None:
            return
        if prefill:
            cache.set_rope(self.cos[positions[0]].unsqueeze(1), self.sin[positions[0]].unsqueeze(1))
        else:
            pos = positions[:, 0]
            cache.set_rope(self.cos[pos].unsqueeze(0), self.sin[pos].unsqueeze(0))

    def bind(self, cache) -> None:
        self.cache = cache
        for a in self.attention:
            a.kv_cache = cache

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._rope is not None:
            self.model.rotary_pos_emb = self._rope
            self._rope = None
        self.bind(None)
        self.last = self.cos = self.sin = None
        return False

    def _last_tokens(self, module, args):
        if self.last is None:
            return None
        hidden = args[0]  # [T, 1, h]: the packed prompts
        return (hidden[self.last, 0].unsqueeze(0),) + tuple(args[1:])


class _NoRope(torch.nn.Module):
    """Stands in for GPTModel's RotaryEmbedding during ``generate``: megatron's Attention gets no
    rotary embedding; the KV cache applies RoPE (same arithmetic) with cos/sin computed once per
    generation and indexed once per call for all layers."""

    def __init__(self, rope):
        super().__init__()
        self.get_rotary_seq_len = rope.get_rotary_seq_len

    def forward(self, *args, **kwargs):
        return None


class Stepper:
    """Runs one model call of a SlotBatch on this stage."""

    def __init__(self, engine, hooks: _Hooks, graphs=None, on_call: Optional[Callable[[], None]] = None):
        self.model, self.hooks, self.graphs = engine.module, hooks, graphs
        self.on_call = on_call  # a progress report before each call
        self.layout = engine.layout
        self.forward_passes = 0
        from puzzle.models.decode_layer import decode_forward

        self.decode_forward = decode_forward

    def __call__(self, sb: SlotBatch, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """Stage input (None on the first stage) -> hidden states [s, n, h] or logits [n, V/T]."""
        call = sb.call
        if self.on_call is not None:
            self.on_call()
        self.hooks.bind(sb.cache)
        self.forward_passes += 1
        if self.graphs is not None and not call.prefill:
            return self.graphs.decode(sb, self.run)
        return self.run(call.ids, call.positions, call.last, hidden)

    def run(self, ids, positions, last, hidden):
        """GPTModel forward of one call (decode when ``last`` is None and the cache decodes)."""
        h = self.hooks
        h.last = last
        h.rope(positions, last is not None)
        if last is None:  # a decode step: the lean forward (same arithmetic) where it applies
            out = self.decode_forward(self.model, ids, positions, hidden)
            if out is not None:
                return out
        if not self.layout.is_first_stage:
            self.model.set_input_tensor(hidden)
        try:
            out = self.model(ids, positions, None, runtime_gather_output=False)
        finally:
            h.last = None
            if not self.layout.is_first_stage:
                self.model.set_input_tensor(None)
        if self.layout.is_last_stage:
            return out[:, -1, :]  # [n, V/T]
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
             micro_batch_size: Optional[int] = None, *, sample_offset: int = 0,
             cuda_graphs: bool = False, compile_graphs: bool = False, batch_invariant: bool = False,
             progress: Optional[Callable[[int, int], None]] = None, stop: Optional[GroupQuota] = None,
             partial_tokens: Optional[List[List[int]]] = None, partial_logprobs=None,
             sample_ids: Optional[List[int]] = None, turns: Optional[TurnHandler] = None,
             partial_turns: Optional[List[Optional[TurnResume]]] = None) -> GenerationOutput:
    """Generate continuations of this DP rank's ``prompts`` with the actor ``engine``.

    Call on every rank of the engine's layout, with the same prompts on all TP/PP ranks of one
    DP group. ``sample_offset`` is the index of the first prompt in the global batch (so DP
    splits do not change sampled tokens). ``micro_batch_size`` (KV-cache rows) defaults to the
    whole batch at P=1 and ceil(b / P) at P>1. ``cuda_graphs``: replay decode steps from CUDA
    graphs (CUDA device, P=1), through torch.compile with ``compile_graphs``. Returns the same
    GenerationOutput on every rank of the replica.
    ``progress(finished, rows)``: called before each model call and at the end with this rank's
    finished responses (a progress display; it must not communicate).
    ``batch_invariant`` (--batch-invariant-mode): every model call and log-prob in
    puzzle/models/batch_invariant.py's mode, whose arithmetic scoring repeats bit for bit (no
    CUDA graphs).

    Partial rollouts (puzzle/rollout/partial.py). ``stop`` (a ``GroupQuota``, P=1): generation
    ends once that many whole groups of rows have finished, counted over this rank's rows (TP
    ranks see the same tokens and stop together; each DP rank meets its own quota); rows left
    running or waiting come back with ``finished`` False and their tokens so far. No whole-step
    CUDA graphs then. ``partial_tokens`` / ``partial_logprobs``: per row a response to continue
    (empty: none), prefilled after the prompt; the row samples from step ``len(partial)`` on, up
    to ``max_new_tokens`` in all, and its output holds the whole response (the given tokens and
    log-probs first). ``sample_ids``: each row's global sample index (default
    ``sample_offset + row``; a resumed row keeps its own, so its noise stream continues).
    Without these arguments the output is the same as before they existed, bit for bit.

    Multi-turn samples (puzzle/rollout/turns.py): ``turns`` answers each row's ended turns with
    observation tokens, appended to the row's response and kept KV cache by a prefill while the
    other rows go on decoding (P=1, any D and T; not with CUDA graphs); the output's
    ``observation_mask`` marks them. At a ``stop`` the steps in flight are joined, their
    observations written (``SlotBatch.flush_turns``); each row's turn state: ``turn_states``;
    ``partial_turns`` gives a resumed row's (None: no observation in it, no turn stepped).
    """
    from puzzle.rollout.pipelined_generation import run_schedule

    b, P = len(prompts), engine.layout.plan.P
    width, resumed, rows_sample_ids, mbs = _checked_arguments(
        engine, prompts, params, sample_offset, micro_batch_size, cuda_graphs, stop,
        (partial_tokens, partial_logprobs, sample_ids), turns, partial_turns)
    model = engine.module
    device = model.puzzle_device
    graphs = _decode_graphs(model, P, device, cuda_graphs, compile_graphs, batch_invariant)
    rtok = None if resumed is None else resumed[0]
    prefills = prompts if rtok is None else [list(p) + list(q) for p, q in zip(prompts, rtok)]
    results = Results.empty(b, params.max_new_tokens, rows_sample_ids, device)
    if resumed is not None:
        _write_partial(results, *resumed)
    batches = _slot_batches(prompts, prefills, rtok, params, mbs, P, results, device,
                            graphs.cache(min(mbs, b), width) if graphs is not None and P == 1 else None)
    tracker = batches[0].turns = _turn_tracker(turns, b, params.max_new_tokens, rtok, partial_turns,
                                               engine.layout.tp_group, device)
    try:
        with _inference_model(model), torch.no_grad(), batch_invariant_mode(batch_invariant), \
                _Hooks(model, width if graphs is None else graphs.width) as hooks, \
                _fast_dispatch(hooks, batches, prefills, batch_invariant):
            if graphs is not None:
                graphs.keep_rope_tables(hooks)
            stepper = Stepper(engine, hooks, graphs, on_call=_progress_report(progress, batches, b))
            run_schedule(engine, batches, stepper, params, seed,
                         stop.tracker() if stop is not None else None)
            if progress is not None:
                progress(b - sum(len(sb.queue) + len(sb.host_active) for sb in batches), b)
            if tracker is not None:  # the steps still in flight joined (a quota stop: the paused rows')
                running = {r for sb in batches for r in sb.flush_turns()}
                tracker.close()
    finally:
        if tracker is not None:  # also on error: stop the steps' thread
            tracker.shutdown()
        if graphs is None:
            for sb in batches:
                sb.cache = None  # drop every KV cache, also on error
    out = _assemble(prompts, results, params, stepper.forward_passes)
    return out if tracker is None else _with_turns(out, tracker, running)


def _checked_arguments(engine, prompts, params, sample_offset, micro_batch_size, cuda_graphs, stop,
                       partial, turns, partial_turns):
    """generate's arguments checked (one ValueError naming the problem; ``partial``: its
    partial_tokens, partial_logprobs and sample_ids): the cache width, the resumed rows' (tokens,
    log-probs) or None, each row's sample id and the micro-batch size."""
    partial_tokens, partial_logprobs, sample_ids = partial
    width = _check_inputs(engine, prompts, params, sample_offset)
    b, P = len(prompts), engine.layout.plan.P
    _check_turns(turns, engine.layout.plan, partial_tokens, cuda_graphs, partial_turns)
    resumed = check_resume(b, params, engine.arch.valid_vocab_size, partial_tokens, partial_logprobs,
                           None if partial_turns is None else [t and t.observation for t in partial_turns])
    rows_sample_ids = check_sample_ids(b, sample_offset, sample_ids)
    _check_stop(stop, b, P)
    mbs = micro_batch_size if micro_batch_size is not None else math.ceil(b / P)
    if not isinstance(mbs, int) or mbs < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1 (got {micro_batch_size!r})")
    return width, resumed, rows_sample_ids, mbs


def _turn_tracker(turns: TurnHandler, rows: int, max_new: int, resumed, partial_turns, tp_group,
                  device) -> Optional[TurnTracker]:
    """The turns of a generation's rows (None without ``turns``), the resumed ones (partial
    rollouts) from their state."""
    if turns is None:
        return None
    tracker = TurnTracker(turns, rows, max_new, tp_group, device)
    for r, state in enumerate(partial_turns or []):
        if resumed[r] or state is not None:
            tracker.resume(r, resumed[r], state or TurnResume((False,) * len(resumed[r]), 0, 0))
    return tracker


def _with_turns(out: GenerationOutput, tracker: TurnTracker, running: set) -> GenerationOutput:
    """``out`` with its rows' turns: the observation mask, counts and turn states; an episode's
    end is its row's end: every row ended but those a quota stop left ``running``."""
    b = len(out.response_lengths)
    out.observation_mask = tracker.observation_mask
    out.turn_counts = dict(tracker.counts, step_wait_seconds=tracker.wait_seconds)
    out.turn_states = [tracker.state(r) for r in range(b)]
    out.finished = torch.tensor([r not in running for r in range(b)], dtype=torch.bool, device=out.finished.device)
    return out


def _decode_graphs(model, P: int, device, cuda_graphs: bool, compile_graphs: bool, batch_invariant: bool):
    """The decode steps' CUDA graphs (``cuda_graphs``), else None."""
    if cuda_graphs and batch_invariant:
        raise ValueError("batch_invariant generation runs eagerly: not with cuda_graphs")
    if not cuda_graphs:
        return None
    from puzzle.rollout.cuda_graphs import DecodeGraphs

    return DecodeGraphs.for_model(model, P, device, compile_graphs)


def _check_turns(turns, plan, partial_tokens, cuda_graphs, partial_turns=None) -> None:
    """Multi-turn rows run at P=1 (any T) without an expert-parallel split, without CUDA graphs;
    resumed rows (partial rollouts) with each one's turn state in ``partial_turns``."""
    if turns is None:
        if partial_turns is not None:
            raise ValueError("partial_turns (the turn state of resumed rows) needs turns (a multi-turn handler)")
        return
    if plan.P != 1 or plan.has_experts_split:
        raise ValueError(f"multi-turn generation (--env) runs at P=1 without an expert-parallel split for now; "
                         f"the actor generates at {plan}")
    if cuda_graphs:
        raise ValueError("multi-turn generation (--env) does not run with CUDA graphs yet")
    if partial_turns is not None and (partial_tokens is None or len(partial_turns) != len(partial_tokens)):
        raise ValueError("partial_turns needs partial_tokens, one entry per prompt")


@contextlib.contextmanager
def _inference_model(model):
    """``model`` in eval mode and without sequence parallelism (megatron runs inference without
    it: a decode step has one position) for the block; both restored after it, also on error."""
    was_training = model.training
    model.eval()
    sequence_parallel = bool(model.config.sequence_parallel)
    if sequence_parallel:
        from megatron.core.transformer.utils import set_model_to_sequence_parallel

        set_model_to_sequence_parallel(model, False)
    try:
        yield
    finally:
        model.train(was_training)
        if sequence_parallel:
            set_model_to_sequence_parallel(model, True)


def _slot_batches(prompts, prefills, resumed, params: SamplingParams, mbs: int, P: int,
                  results: Results, device, cache) -> List[SlotBatch]:
    """P=1: one cache of ``mbs`` rows, refilled as rows finish; P>1: length buckets of ``mbs``
    rows, one cache each, pipelined. Rows are served in ``service_order`` of their prefills."""
    order, b = service_order(prefills), len(prompts)
    if P == 1:
        return [SlotBatch(order, prompts, params, min(mbs, b), results, device, cache, resumed)]
    return [SlotBatch(order[i:i + mbs], prompts, params, len(order[i:i + mbs]), results, device,
                      resumed=resumed) for i in range(0, b, mbs)]


def _check_stop(stop: Optional[GroupQuota], rows: int, P: int) -> None:
    if stop is None:
        return
    if not isinstance(stop, GroupQuota):
        raise ValueError(f"stop must be a GroupQuota (got {type(stop).__name__})")
    stop.check(rows)
    if P > 1:
        raise ValueError("stop (a finished-groups quota) works at P=1 only: at P>1 the pipelined "
                         "length buckets each run to completion")


def _check_inputs(engine, prompts: List[List[int]], params: SamplingParams, sample_offset: int) -> int:
    """generate's arguments checked (one ValueError naming the problem); returns the cache width,
    the longest prompt plus max_new_tokens."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams (got {type(params).__name__})")
    if engine.module is None:
        raise ValueError(f"rank {engine.layout.rank} is not in the {engine.role} layout "
                         f"{engine.layout.plan}; only its ranks call generate")
    arch = engine.arch
    _check_prompts(prompts, arch.vocab_size)
    if any(i >= arch.valid_vocab_size for i in params.stop_ids):
        raise ValueError(f"eos_id/eos_ids {params.stop_ids} are outside the vocabulary ({arch.valid_vocab_size} "
                         f"ids can be sampled)")
    if not isinstance(sample_offset, int) or sample_offset < 0:
        raise ValueError(f"sample_offset must be an int >= 0 (got {sample_offset!r})")
    lp = max(len(p) for p in prompts)
    width = lp + params.max_new_tokens
    if width > arch.max_position_embeddings:
        raise ValueError(f"longest prompt ({lp}) + max_new_tokens ({params.max_new_tokens}) = "
                         f"{width} exceeds max_position_embeddings={arch.max_position_embeddings}")
    return width


def _progress_report(progress, batches: List[SlotBatch], rows: int):
    """``progress(finished, rows)`` from the slot batches' host state (no device sync), or None."""
    if progress is None:
        return None

    def report():
        pending = sum(len(sb.queue) + len(sb.host_active) + len(sb.paused) + len(sb.appends)
                      + (len(sb.call_slots) if sb.call is not None and sb.call.prefill else 0) for sb in batches)
        progress(rows - pending, rows)

    return report


def _fast_dispatch(hooks: _Hooks, batches: List[SlotBatch], prompts: List[List[int]], batch_invariant: bool):
    """On the CPU backend: the decode loop runs without its device-mapping mode (it costs a
    Python call per torch call). megatron's unfused attention takes its score buffer from
    megatron's global memory buffer, allocated on the "cuda" device when it grows: it is grown
    first, with the mode on, to the largest scores of this generation (a decode step over a
    whole cache, a prefill's longest prompt, a multi-turn row's appended tokens), so the loop
    never allocates it. In
    ``batch_invariant`` generation (whose attention uses no such buffer) the device-mapping mode
    is taken off the torch-function stack, leaving the batch-invariant mode working."""
    import megatron_patches

    from puzzle.models.sdpa_attention import UnfusedCoreAttention

    if not megatron_patches.on_cpu():
        return contextlib.nullcontext()
    if getattr(hooks.model.config, "num_moe_experts", None):
        # prefills (and eager decode steps) run megatron's MoE router and dispatchers, which name
        # CUDA devices (the static MoE decode step of the graph path does not)
        return contextlib.nullcontext()
    if batch_invariant:
        return _batch_invariant_alone()
    unfused = [a for a in hooks.attention if isinstance(a, UnfusedCoreAttention)]
    if unfused:
        from megatron.core import parallel_state

        heads = max(a.num_attention_heads_per_partition for a in unfused)
        longest = max(len(p) for p in prompts)
        # a multi-turn row's appended tokens attend to its cached keys: up to width x width scores
        appended = max(sb.cache.width ** 2 if sb.turns is not None else 0 for sb in batches)
        scores = heads * max(max(sb.slots * sb.cache.width for sb in batches), longest * longest, appended)
        dtype = hooks.model.config.params_dtype
        parallel_state.get_global_memory_buffer().get_tensor((scores,), dtype, "mpu")
    from megatron_patches import cpu_backend

    return cpu_backend.device_mapping_suspended()


@contextlib.contextmanager
def _batch_invariant_alone():
    """The batch-invariant mode (on when this is entered) as the only torch-function mode: it is
    taken off the stack, then the device-mapping mode under it, and it is put back alone."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    from megatron_patches import cpu_backend
    from puzzle.models import batch_invariant

    stack = _get_current_function_mode_stack()
    if len(stack) != 2 or not batch_invariant.is_mode(stack[1]):  # modes of others: leave them on
        yield
        return
    with _pop_mode_temporarily(), cpu_backend.device_mapping_popped(), batch_invariant_mode():
        yield


def _write_partial(results: Results, tokens: List[List[int]], logprobs: List[torch.Tensor]) -> None:
    """The resumed rows' partial responses (and their log-probs as sampled) into the results."""
    for r, (tok, lp) in enumerate(zip(tokens, logprobs)):
        if tok:
            n = len(tok)
            results.out[r, :n] = torch.tensor(tok, dtype=torch.long)
            results.logprobs[r, :n] = lp.to(results.logprobs.device)
            results.resp_len[r] = n


def _assemble(prompts, results: Results, params: SamplingParams, forward_passes: int) -> GenerationOutput:
    """The responses in response coordinates, pad after each one (on the device: the batch is
    assembled there, puzzle/dataflow/batch.py). A row finished iff it ends with a stop id or has
    max_new_tokens tokens (a row stops at exactly these)."""
    rlen = results.resp_len
    keep = torch.arange(params.max_new_tokens, device=rlen.device).unsqueeze(0) < rlen.unsqueeze(1)
    tokens = torch.where(keep, results.out, torch.full((), params.pad_id, dtype=torch.long, device=rlen.device))
    logprobs = torch.where(keep, results.logprobs, torch.zeros((), device=rlen.device))
    last = results.out.gather(1, (rlen - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    stop_ids = torch.tensor(list(params.stop_ids), dtype=torch.long, device=rlen.device)
    stopped = torch.isin(last, stop_ids) & (rlen > 0)
    return GenerationOutput(response_tokens=tokens, response_lengths=rlen,
                            prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long),
                            forward_passes=forward_passes, logprobs=logprobs,
                            finished=stopped | (rlen >= params.max_new_tokens))
