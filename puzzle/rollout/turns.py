"""Multi-turn samples in the decode loop (``generate(..., turns=handler)``, P=1, any D and T).

A sample's response is its turns one after another, the observations an environment answered
between them inserted as they came: token in, token out. The trained sequence is exactly the
sampled tokens plus the observation tokens as inserted; nothing is detokenized and retokenized.

How a row runs (``TurnTracker``, driven by ``SlotBatch``, puzzle/rollout/generation.py):

- its turn ends when its tokens since the turn began end with one of the handler's ``stops``
  (token sequences: a tool call's closing tag), or the row ends anyway (a stop id such as EOS,
  or ``max_new_tokens``, which bounds the whole sample, observations included; observation
  tokens are never checked for stop ids: Qwen's ``<|im_end|>`` closes the model's turn inside
  its tool response);
- the ended turn is submitted to the handler's ``step`` (the environment, in the reward worker
  pool) and the row is paused: it leaves the decode calls but keeps its slot and KV cache while
  the other rows go on decoding;
- the row's step is joined at a fixed point of the loop's call clock (the model calls run so
  far): submitted after call s, it is joined after call s + k (k = the handler's
  ``overlap_calls``; when no other row can run the clock jumps to the next join), waiting there
  only if the step is not done yet, and its observation is inserted there, never earlier. The
  batch composition of every model call therefore depends only on the tokens, never on how fast
  the environment answered: runs are reproducible, at any number of env workers. k = 0 joins
  the step before the next call (every row waits for it);
- the observation (token ids, or None when the episode is done) is appended to the row's kept
  KV cache by a prefill, packed with the other rows joined at that call and the new prompts
  (each segment at its slot's own positions: the turn's last sampled token, not yet in the
  cache, then the observation), and the row samples its next token from the segment's last
  logits, as after a prompt. Observation tokens get log-prob 0 and ``observation_mask`` True;
- limits: ``max_turns`` turns (the last one is stepped with ``final`` set and the row ends
  without waiting for it; an episode that wanted more is counted in ``turn_limit_cuts``), the
  token budget (an observation cut to the room left; a row that ends inside an observation or
  right after it: ``token_limit_cuts``); the handler caps each observation's own tokens
  (``max_observation_tokens``);
- a partial rollout's quota stop (``generate(stop=)``) comes after a model call, once the joins
  due at its clock are done; then every step still in flight is joined (``flush``: waited for,
  whatever its due clock) and its observation written into the row's response as a join writes
  it (log-prob 0, ``observation_mask`` True, cut to the budget: a row it takes to the budget, or
  whose episode it ends, has ended). Which rows are paused at the stop and which observations
  are written there depend only on the tokens (the stop, like the joins, follows the call clock),
  never on how fast the steps ran. A row left running never has an observation pending: it is
  carried as its response and ``TurnResume`` and resumes by a prefill of prompt + response
  (observations included), sampling its next token as the uninterrupted run does after the
  observation (``generate(partial_turns=)``).

Where the steps run. A handler whose steps wait on worker processes (``steps_in_background``:
the env worker pool) is stepped in one background thread from the submission on, so the pool
works while the model decodes; the batches submitted while a step call runs go into the next one
together (the pool runs them side by side). Otherwise (an in-process environment) a batch runs at
its join. At T > 1 only the tensor-parallel group's first rank steps; the observation
ids are broadcast over the group at the join, so every TP rank inserts the same tokens.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

import torch

from puzzle.rollout.sampling import tp_rank, tp_size


class TurnHandler(Protocol):
    """What answers the rows' turns (the dataflow's environment episodes). Optional attributes:
    ``overlap_calls`` (int, default 0: model calls a step may take before its row's join) and
    ``steps_in_background`` (bool, default False: ``step`` may run in a background thread)."""

    stops: Sequence[Sequence[int]]  # token sequences that end a turn
    max_turns: int

    def step(self, rows: List[int], turns: List[List[int]], histories: List[List[int]],
             final: List[bool]) -> List[Optional[List[int]]]:
        """For each row whose turn ended: its turn's token ids (after ``histories[i]``, the
        response before the turn) -> the observation's token ids to insert, or None when its
        episode is done. ``final``: the row ends anyway; an observation is then only counted."""


@dataclass(frozen=True)
class TurnResume:
    """A row's turn bookkeeping where a partial rollout stopped it (``generate(partial_turns=)``):
    the observation mask of its partial response, the turns stepped and the response column of
    its current turn's first token. It never has an observation pending (``TurnTracker.flush``)."""

    observation: Tuple[bool, ...]
    turns: int
    turn_start: int


class _Steps:
    """One batch of ended turns submitted together (the rows of one model call)."""

    def __init__(self, rows: List[int], finals: List[bool], finished: List[bool], due: int, args, future=None):
        self.rows, self.finals, self.finished, self.due = rows, finals, finished, due
        self.args, self.future = args, future


class TurnTracker:
    """The turns of ``rows`` rows of one ``generate`` (host state).

    ``tp_group``: the generating replica's tensor-parallel group (None or 1 rank: this rank
    steps); its first rank steps and broadcasts the observations over it from ``device``."""

    def __init__(self, handler: TurnHandler, rows: int, max_new: int, tp_group=None, device=None):
        self.handler, self.max_new = handler, max_new
        self.stops = [list(s) for s in handler.stops if len(s)]
        self.overlap_calls = int(getattr(handler, "overlap_calls", 0) or 0)
        if self.overlap_calls < 0:
            raise ValueError(f"overlap_calls must be >= 0 (got {self.overlap_calls})")
        self.tp_group, self.device = tp_group, device
        self.stepping = tp_rank(tp_group) == 0  # this rank calls the handler
        background = self.stepping and bool(getattr(handler, "steps_in_background", False))
        self.executor = _Stepper(handler) if background else None
        self.tokens: List[List[int]] = [[] for _ in range(rows)]  # each row's response so far
        self.turn_start = [0] * rows                     # response column of the turn's first token
        self.turns = [0] * rows
        self.observation_mask = torch.zeros(rows, max_new, dtype=torch.bool)
        self.inflight: List[_Steps] = []                 # submitted, not joined (in clock order)
        self.wait_seconds = 0.0  # the decode loop's time in joins (waiting for steps, or running them)
        self.counts = {"turns": 0, "observation_tokens": 0, "turn_limit_cuts": 0, "token_limit_cuts": 0}

    def resume(self, r: int, tokens: List[int], state: TurnResume) -> None:
        """Row r continues a partial response ``tokens`` (its first ``len(tokens)`` columns)."""
        n = len(tokens)
        if len(state.observation) != n or not 0 <= state.turn_start <= n or state.turns < 0:
            raise ValueError(f"row {r}: the turn state of its partial response does not fit its {n} tokens")
        self.tokens[r] = list(tokens)
        self.observation_mask[r, :n] = torch.tensor(state.observation, dtype=torch.bool)
        self.turns[r], self.turn_start[r] = state.turns, state.turn_start

    def state(self, r: int) -> TurnResume:
        n = len(self.tokens[r])
        return TurnResume(tuple(self.observation_mask[r, :n].tolist()), self.turns[r], self.turn_start[r])

    def record(self, rows: List[int], tok: torch.Tensor) -> None:
        """A call's sampled tokens (one per row of ``rows``)."""
        for r, t in zip(rows, tok.tolist()):
            self.tokens[r].append(t)

    def _ends_turn(self, r: int) -> bool:
        turn = self.tokens[r][self.turn_start[r]:]
        return any(len(turn) >= len(s) and turn[-len(s):] == s for s in self.stops)

    def end_turns(self, rows: List[int], finished: List[bool], clock: int) -> List[str]:
        """After the call that made ``clock`` calls: each row "go"es on, "end"s now, or "pause"s
        (its turn ended: stepped, joined at ``clock + overlap_calls``)."""
        out, ask = [], []
        for r, fin in zip(rows, finished):
            if not (fin or self._ends_turn(r)):
                out.append("go")
                continue
            self.turns[r] += 1
            final = fin or self.turns[r] >= self.handler.max_turns
            ask.append((r, final, fin))
            out.append("end" if final else "pause")
        if ask:
            self.counts["turns"] += len(ask)
            self._submit(ask, clock + self.overlap_calls)
        return out

    def _submit(self, ask: List[Tuple[int, bool, bool]], due: int) -> None:
        rows = [r for r, _, _ in ask]
        args = (rows, [self.tokens[r][self.turn_start[r]:] for r in rows],
                [self.tokens[r][:self.turn_start[r]] for r in rows], [final for _, final, _ in ask])
        batch = _Steps(rows, args[3], [fin for _, _, fin in ask], due, args)
        if self.executor is not None:
            self.executor.submit(batch)
        self.inflight.append(batch)

    def next_due(self) -> Optional[int]:
        """The clock of the next join (None: nothing in flight)."""
        return self.inflight[0].due if self.inflight else None

    def join(self, clock: int) -> List[Tuple[int, List[int], bool]]:
        """The steps due at ``clock`` (or before), joined: for each paused row, in submission
        order, ``(row, observation, goes_on)``: the observation tokens now in the row's response
        (cut to the budget), and whether the row samples again (False: its episode is done or
        its budget spent)."""
        due = [s for s in self.inflight if s.due <= clock]
        if not due:
            return []
        self.inflight = self.inflight[len(due):]
        observations = self._share(due)
        out = []
        for batch, found in zip(due, observations):
            for r, final, fin, obs in zip(batch.rows, batch.finals, batch.finished, found):
                if final:  # the row ended at its submission: the answer is only counted
                    self.counts["turn_limit_cuts"] += obs is not None and not fin
                    continue
                out.append((r, [], False) if obs is None else self._insert(r, obs))
        return out

    def _insert(self, r: int, obs: List[int]) -> Tuple[int, List[int], bool]:
        n = len(self.tokens[r])
        obs = list(obs)[:self.max_new - n]  # the rest of the budget
        self.tokens[r] += obs
        self.observation_mask[r, n:n + len(obs)] = True
        self.counts["observation_tokens"] += len(obs)
        self.turn_start[r] = n + len(obs)
        goes_on = n + len(obs) < self.max_new  # else no room to sample after it
        self.counts["token_limit_cuts"] += not goes_on
        return r, obs, goes_on

    def _share(self, due: List[_Steps]) -> List[List[Optional[List[int]]]]:
        """Each due batch's observations, from the stepping rank to every rank of the TP group."""
        found = None
        if self.stepping:
            t0 = time.perf_counter()
            found = [s.future.result() if s.future is not None else self.handler.step(*s.args) for s in due]
            self.wait_seconds += time.perf_counter() - t0
            for s, obs in zip(due, found):
                if len(obs) != len(s.rows):
                    raise ValueError(f"the turn handler answered {len(obs)} observations for {len(s.rows)} turns")
        if tp_size(self.tp_group) > 1:
            found = _broadcast_observations(found, [len(s.rows) for s in due], self.tp_group, self.device)
        return found

    def flush(self) -> List[Tuple[int, List[int], bool]]:
        """A partial rollout's quota stop: every step still in flight joined now, whatever its
        due clock (waited for: an environment step, not model work), answered as ``join``
        answers (the observations in the rows' responses, counted as at their own joins)."""
        return self.join(max(s.due for s in self.inflight)) if self.inflight else []

    def close(self) -> None:
        """Joins every step still in flight (the last turns': their rewards) and stops the
        background thread. Called once the rows have ended (or on error: nothing joined)."""
        try:
            self.flush()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stops the background thread (after the step it runs, if any)."""
        if self.executor is not None:
            self.executor.stop()
            self.executor = None


class _Stepper:
    """The background thread of a handler whose steps wait on worker processes: every batch
    submitted while it was busy goes into its next ``step`` call together (one call of the pool
    for all of them: the workers run them side by side), each batch's answers to its future."""

    def __init__(self, handler: TurnHandler):
        self.handler, self.queue, self.closing = handler, [], False
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._serve, name="env-steps", daemon=True)
        self.thread.start()

    def submit(self, batch: _Steps) -> None:
        batch.future = Future()
        with self.ready:
            self.queue.append(batch)
            self.ready.notify()

    def _serve(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.closing:
                    self.ready.wait()
                if not self.queue:
                    return
                batches, self.queue = self.queue, []
            args = [sum((b.args[i] for b in batches), []) for i in range(4)]
            try:
                found = list(self.handler.step(*args))
            except BaseException as e:  # raised at the join of each batch
                for b in batches:
                    b.future.set_exception(e)
                continue
            at = 0
            for b in batches:
                b.future.set_result(found[at:at + len(b.rows)])
                at += len(b.rows)

    def stop(self) -> None:
        with self.ready:
            for b in self.queue:  # not started (an error ended the generation): dropped
                b.future.cancel()
            self.queue, self.closing = [], True
            self.ready.notify()
        self.thread.join()


def _broadcast_observations(found, counts: List[int], group, device) -> List[List[Optional[List[int]]]]:
    """The observations (a list per batch of token-id lists or None) from the group's first rank
    to all of its ranks: their lengths (-1: None), then their tokens, two broadcasts."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    total = sum(counts)
    lengths = torch.empty(total, dtype=torch.long, device=device)
    if found is not None:
        flat_obs = [o for batch in found for o in batch]
        lengths.copy_(torch.tensor([-1 if o is None else len(o) for o in flat_obs], dtype=torch.long))
    dist.broadcast(lengths, src=src, group=group)
    sizes = lengths.tolist()
    tokens = torch.empty(sum(max(0, n) for n in sizes), dtype=torch.long, device=device)
    if found is not None and tokens.numel():
        tokens.copy_(torch.tensor([t for o in flat_obs if o is not None for t in o], dtype=torch.long))
    if tokens.numel():
        dist.broadcast(tokens, src=src, group=group)
    ids, out, at, k = tokens.tolist(), [], 0, 0
    for c in counts:
        batch = []
        for n in sizes[k:k + c]:
            batch.append(None if n < 0 else ids[at:at + n])
            at += max(0, n)
        out.append(batch)
        k += c
    return out
