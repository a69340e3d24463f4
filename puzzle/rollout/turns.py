"""Multi-turn samples in the decode loop (``generate(..., turns=handler)``, P=1).

A sample's response is its turns one after another, the observations an environment answered
between them inserted as they came: token in, token out. The trained sequence is exactly the
sampled tokens plus the observation tokens as inserted; nothing is detokenized and retokenized.

How a row runs (``TurnTracker``, driven by ``SlotBatch.advance``):

- its turn ends when its tokens since the turn began end with one of the handler's ``stops``
  (token sequences: a tool call's closing tag), or the row ends anyway (a stop id such as EOS,
  or ``max_new_tokens``, which bounds the whole sample, observations included; an observation
  token ends its row only at the budget: it may be a stop id, as Qwen's ``<|im_end|>`` that closes
  the model's turn before a tool response);
- the handler's ``step`` (the environment, in the reward worker pool) answers each ended turn
  with the observation's token ids, or None when the episode is done; the row's next steps then
  feed those tokens into its kept KV cache one per decode step, in place of the token it samples
  (log-prob 0, ``observation_mask`` True), while the other rows go on decoding; after the last
  observation token the row samples again;
- limits: ``max_turns`` turns (the last one is stepped with ``final`` set; an episode that
  wanted more is counted in ``turn_limit_cuts``), the token budget (an observation cut to the
  room left, a row that ends inside an observation or right after it: ``token_limit_cuts``); the handler
  caps each observation's own tokens (``max_observation_tokens``).

The rows' steps run between two model calls (every row of the batch waits for them); each
observation token costs its row one decode step (a prefill of it into the row's cache would be
one call for all of them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

import torch


class TurnHandler(Protocol):
    """What answers the rows' turns (the dataflow's environment episodes)."""

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


class TurnTracker:
    """The turns of ``rows`` rows of one ``generate`` (host state; one ``tolist`` per call)."""

    def __init__(self, handler: TurnHandler, rows: int, max_new: int):
        self.handler, self.max_new = handler, max_new
        self.stops = [list(s) for s in handler.stops if len(s)]
        self.pending = [deque() for _ in range(rows)]   # observation tokens still to insert
        self.tokens: List[List[int]] = [[] for _ in range(rows)]  # each row's response so far
        self.turn_start = [0] * rows                     # response column of the turn's first token
        self.turns = [0] * rows
        self.observation_mask = torch.zeros(rows, max_new, dtype=torch.bool)
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

    def flush(self, r: int) -> Tuple[List[int], bool]:
        """Row r stopped (a partial rollout's quota): its pending observation tokens written into
        its response now (they do not depend on the weights), and whether that ends the row (it
        reached the token budget, counted as the uninterrupted run counts it)."""
        obs = list(self.pending[r])
        self.pending[r].clear()
        n = len(self.tokens[r])
        self.observation_mask[r, n:n + len(obs)] = True
        self.tokens[r] += obs
        ended = bool(obs) and len(self.tokens[r]) >= self.max_new
        self.counts["token_limit_cuts"] += ended
        return obs, ended

    def insert(self, rows: List[int], steps: List[int], tok: torch.Tensor,
               logprob: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The call's sampled tokens with each row that has an observation pending given its
        next observation token instead (log-prob 0)."""
        forced = [(i, self.pending[r].popleft()) for i, r in enumerate(rows) if self.pending[r]]
        if forced:
            tok, logprob = tok.clone(), logprob.clone()
            where = torch.tensor([i for i, _ in forced], dtype=torch.long, device=tok.device)
            tok[where] = torch.tensor([t for _, t in forced], dtype=tok.dtype, device=tok.device)
            logprob[where] = 0.0
            for i, _ in forced:
                self.observation_mask[rows[i], steps[i]] = True
        for r, t in zip(rows, tok.tolist()):
            self.tokens[r].append(t)
        return tok, logprob

    def _ends_turn(self, r: int) -> bool:
        turn = self.tokens[r][self.turn_start[r]:]
        return any(len(turn) >= len(s) and turn[-len(s):] == s for s in self.stops)

    def end_turns(self, rows: List[int], finished: List[bool]) -> List[bool]:
        """After a call: the rows whose turn ended are stepped; returns which rows end now."""
        out, ask = list(finished), []
        for i, r in enumerate(rows):
            n = len(self.tokens[r])
            if self.pending[r] or n == self.turn_start[r]:  # mid-observation, or no model token yet:
                out[i] = n >= self.max_new  # only the budget ends it (an observation token may be a stop id)
                self.counts["token_limit_cuts"] += out[i]
                continue
            if finished[i] or self._ends_turn(r):
                self.turns[r] += 1
                ask.append((i, r, finished[i] or self.turns[r] >= self.handler.max_turns))
        if not ask:
            return out
        self.counts["turns"] += len(ask)
        observations = self.handler.step([r for _, r, _ in ask],
                                         [self.tokens[r][self.turn_start[r]:] for _, r, _ in ask],
                                         [self.tokens[r][:self.turn_start[r]] for _, r, _ in ask],
                                         [final for _, _, final in ask])
        for (i, r, final), obs in zip(ask, observations):
            if obs is None or final:
                out[i] = True
                self.counts["turn_limit_cuts"] += obs is not None and not finished[i]
                continue
            n = len(self.tokens[r])
            obs = list(obs)[:self.max_new - n]  # the rest of the budget (counted when the row ends)
            self.pending[r].extend(obs)
            self.counts["observation_tokens"] += len(obs)
            self.turn_start[r] = n + len(obs)
        return out
