"""The generation stage with --rl-partial-rollouts (puzzle/rollout/partial.py has the mechanics).

Each iteration serves ``ceil(oversample x G)`` groups (G: the batch's prompts): the carried groups
first, oldest first, then fresh prompts in data order (the iteration's, then more from the
loader when short). Generation stops once G whole groups have finished; the first G finished
groups in serving order are the batch, and every other sample (running, waiting, or finished in a
group not taken) goes back to the buffer with its tokens, their log-probs as sampled and the
policy version of each token. A carried sample resumes by a prefill of prompt + partial response
under the run-wide seed and its own global sample index (prompt index x N + sample index), so its
noise stream continues where it stopped.

Multi-turn samples (``--env`` with ``--max-turns`` > 1) are carried mid-episode: with its tokens
(sampled and observation), their log-probs and versions, the sample carries its episode
(``partial.EpisodeState``: the observation mask, the turns stepped, the rewards and per-turn
reward columns so far, the last step's error and the environment's instance). A stopped row
never waits for a step or holds half an observation: generate writes a pending observation whole
into its response at the stop. A carried episode resumes through the same environment instance
(in memory); after a checkpoint load the instance is rebuilt by replaying the recorded turns on a
fresh ``reset(record)`` one (``replay_episodes``; an observation the replay does not reproduce is
counted in ``env_replay_mismatches``). The batch's scores are its episodes' (``episodes``); its
per-sample episode metrics are the trained samples' own (``episode_results``).

The policy version of the weights that generate at iteration ``it`` is ``it - 1`` (the
iterations trained before). With --rl-partial-rollouts-max-staleness K the batch's
``policy_loss_mask`` takes the tokens sampled under a version older than ``it - 1 - K`` out of the
actor's loss (they stay context, scored and in the advantages); it is derived from the tokens'
versions, which the checkpoint keeps, so a resumed run masks the same tokens.

Everything here is collective and ends identical on every rank: the one generating share's rows
are handed to all ranks before the buffer is updated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from puzzle.dataflow.batch import RolloutBatch, right_padded_rows, world_rows
from puzzle.dataflow.env_turns import EpisodeResults, gather_episode_counts
from puzzle.rollout.partial import (EpisodeState, GroupQuota, PartialRolloutBuffer, PartialSample, stale_token_mask,
                                    staleness)


def seed_of_run(cfg) -> int:
    """The generation seed of every iteration with partial rollouts (run-wide: a carried sample
    keeps its noise stream across iterations)."""
    return cfg.seed * 100003


class PartialRollouts:
    """The buffer of carried samples, the prompts they belong to and the fresh prompts not served
    yet (all checkpointed: ``state_dict``)."""

    def __init__(self, cfg, tokenizer, device: torch.device, seq_multiple: int = 1, multi_turn: bool = False):
        self.cfg, self.ppo, self.tokenizer = cfg, cfg.ppo, tokenizer
        self.device, self.seq_multiple = device, seq_multiple
        self.multi_turn = multi_turn  # the samples are episodes of --env (--max-turns > 1)
        self.episodes: Optional[EpisodeResults] = None  # multi-turn: the last run()'s batch's episodes
        self.buffer = PartialRolloutBuffer()
        self.prompts: Dict[int, Tuple[List[int], dict]] = {}  # prompt index -> (token ids, record)
        self.pending: List[int] = []  # drawn, not served yet (data order)
        self.drawn = 0                # prompts drawn so far: the next prompt index

    def _draw(self, prompt_ids: List[List[int]], records: List[dict]) -> None:
        for ids, rec in zip(prompt_ids, records):
            self.prompts[self.drawn] = (list(ids), rec)
            self.pending.append(self.drawn)
            self.drawn += 1

    def serve(self, prompt_ids, records, refill: Optional[Callable], version: int
              ) -> Tuple[List[int], List[PartialSample]]:
        """(the served groups' prompt indices in serving order, their samples); fresh samples
        start at ``version``."""
        N, G = self.ppo.n_samples_per_prompt, len(prompt_ids)
        self._draw(prompt_ids, records)
        want = max(G, math.ceil(self.ppo.rl_partial_rollouts_oversample * G))
        carried = self.buffer.take(want)
        order = list(dict.fromkeys(s.prompt_index for s in carried))
        while len(order) + len(self.pending) < want and refill is not None:
            self._draw(*refill())
        fresh = self.pending[:want - len(order)]
        del self.pending[:len(fresh)]
        seed = seed_of_run(self.cfg)
        new = [PartialSample(p, j, p * N + j, seed, version, torch.zeros(0, dtype=torch.long), torch.zeros(0),
                             torch.zeros(0, dtype=torch.long), episode=EpisodeState.fresh() if self.multi_turn else None)
               for p in fresh for j in range(N)]
        return order + fresh, carried + new

    def run(self, engine, sample_fn, prompt_ids, records, refill: Optional[Callable], iteration: int):
        """(batch, records, per-token versions [B, R] (-1 after a response), sample ids, stats).
        ``sample_fn(engine, rows, partial_tokens, partial_logprobs, sample_ids, stop)`` -> every
        rank's (responses [b, R], lengths [b], logprobs [b, R], finished [b]); multi-turn, also
        given ``records=`` and ``episodes=`` (each row's record and ``EpisodeState``), it returns a
        fifth item, a ``TurnOutcome``."""
        N, G = self.ppo.n_samples_per_prompt, len(prompt_ids)
        version = iteration - 1
        order, samples = self.serve(prompt_ids, records, refill, version)
        position = {p: k for k, p in enumerate(order)}
        todo = [i for i, s in enumerate(samples) if not s.finished]
        open_groups = {s.prompt_index for s in samples if not s.finished}
        done_before = sum(1 for p in order if p not in open_groups)  # every sample finished earlier
        outcome = None
        if todo and G > done_before:
            rows = [samples[i] for i in todo]
            quota = GroupQuota(tuple(position[s.prompt_index] for s in rows), G - done_before)
            turn_args = {"records": [self.prompts[s.prompt_index][1] for s in rows],
                         "episodes": [s.episode for s in rows]} if self.multi_turn else {}
            resp, lengths, lps, finished, *more = sample_fn(
                engine, [self.prompts[s.prompt_index][0] for s in rows], [s.tokens.tolist() for s in rows],
                [s.logprobs for s in rows], [s.sample_id for s in rows], quota, **turn_args)
            outcome = more[0] if more else None
            for k, i in enumerate(todo):
                n = int(lengths[k])
                samples[i] = samples[i].extended(resp[k, :n], lps[k, :n], version, bool(finished[k]),
                                                 outcome.states[k] if outcome is not None else None)
        taken, kept = self._split(order, samples, G)
        self.buffer.put(kept)
        batch, versions = self._batch(taken, version)
        stats = staleness([s.versions for s in taken], version, self.ppo.rl_partial_rollouts_max_staleness)
        stats.update(partial_groups_served=len(order), partial_buffer_samples=len(self.buffer))
        if self.multi_turn:
            self.episodes = episode_results(taken, outcome, self.ppo.max_new_tokens, self.device)
            stats.update(self.episodes.metrics(len(taken)),
                         env_replay_mismatches=outcome.replay_mismatches if outcome is not None else 0)
        if N > 1:
            batch = batch.with_outputs("generation", group_index=torch.arange(batch.size, device=batch.device) // N)
        groups = list(dict.fromkeys(s.prompt_index for s in taken))
        taken_records = [self.prompts.pop(p)[1] for p in groups]  # a trained prompt is not needed any more
        return batch, taken_records, versions, [s.sample_id for s in taken], stats

    def _split(self, order: List[int], samples: List[PartialSample], G: int):
        """The first G whole finished groups in serving order (prompt-major, by sample index), and
        every other sample."""
        by_group: Dict[int, List[PartialSample]] = {p: [] for p in order}
        for s in samples:
            by_group[s.prompt_index].append(s)
        complete = [p for p in order if all(s.finished for s in by_group[p])][:G]
        if len(complete) < G:
            raise RuntimeError(f"partial rollouts: {len(complete)} whole groups finished of the {G} needed")
        chosen = set(complete)
        taken = [s for p in complete for s in sorted(by_group[p], key=lambda s: s.sample_index)]
        return taken, [s for s in samples if s.prompt_index not in chosen]

    def _batch(self, taken: List[PartialSample], version: int) -> Tuple[RolloutBatch, torch.Tensor]:
        """The world's batch of the taken samples (the behaviour log-probs as ``gen_logprobs``; with
        --rl-partial-rollouts-max-staleness the ``policy_loss_mask`` of the tokens older than
        ``version`` - K) and each token's policy version."""
        R, pad = self.ppo.max_new_tokens, self.tokenizer.pad_id
        B = len(taken)
        responses = torch.full((B, R), pad, dtype=torch.long)
        logprobs = torch.zeros((B, R), dtype=torch.float32)
        versions = torch.full((B, R), -1, dtype=torch.long)
        for b, s in enumerate(taken):
            n = len(s.tokens)
            responses[b, :n], logprobs[b, :n], versions[b, :n] = s.tokens, s.logprobs, s.versions
        lengths = torch.tensor([len(s.tokens) for s in taken], dtype=torch.long)
        prompt_ids = [self.prompts[s.prompt_index][0] for s in taken]
        prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
        seq = -(-int((prompt_lengths + R).max()) // self.seq_multiple) * self.seq_multiple
        dev = self.device
        tokens = right_padded_rows(prompt_ids, responses.to(dev), lengths.to(dev), seq, pad)
        loss_mask = None
        if self.multi_turn:  # observation tokens: no loss
            loss_mask = torch.ones((B, R), dtype=torch.float32)
            for b, s in enumerate(taken):
                loss_mask[b, :len(s.tokens)] = (~s.episode.observation).float()
            loss_mask = loss_mask.to(dev)
        K = self.ppo.rl_partial_rollouts_max_staleness
        policy_mask = stale_token_mask(versions, version, K).to(dev) if K is not None else None
        return RolloutBatch(tokens, prompt_lengths.to(dev), lengths.to(dev), R, gen_logprobs=logprobs.to(dev),
                            loss_mask=loss_mask, policy_loss_mask=policy_mask), versions

    # ---- checkpoints (trainer_state.json: plain lists) ---------------------------------------
    def state_dict(self) -> dict:
        buf = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in self.buffer.state_dict().items()}
        return {"buffer": buf, "prompts": [[p, ids, rec] for p, (ids, rec) in sorted(self.prompts.items())],
                "pending": list(self.pending), "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        dtypes = {"finished": torch.bool, "logprobs": torch.float32, "observation": torch.bool}
        if self.multi_turn != ("episodes" in state["buffer"]) and state["buffer"]["lengths"]:
            raise ValueError(f"the checkpoint's partial rollouts are {'single' if self.multi_turn else 'multi'}-turn "
                             f"samples, this run's {'multi' if self.multi_turn else 'single'}-turn (--max-turns)")
        self.buffer.load_state_dict({k: v if k == "episodes" else torch.tensor(v, dtype=dtypes.get(k, torch.long))
                                     for k, v in state["buffer"].items()})
        self.prompts = {int(p): (list(ids), rec) for p, ids, rec in state["prompts"]}
        self.pending = [int(p) for p in state["pending"]]
        self.drawn = int(state["drawn"])


def gather_generation(out, layout, rows: int, R: int, device: torch.device):
    """Every rank's copy of the generating share's rows (``out``: its GenerationOutput, None off the
    layout): (responses [b, R], lengths [b], logprobs [b, R] float32, finished [b] bool), on the CPU."""
    owners = layout.plan.generation_owners()
    local = lp = None
    if out is not None:
        local = torch.cat([out.response_tokens, out.response_lengths.unsqueeze(1),
                           out.finished.long().unsqueeze(1)], 1)
        lp = out.logprobs
    both = world_rows(local, owners, rows, (R + 2,), torch.long, device).cpu()
    lps = world_rows(lp, owners, rows, (R,), torch.float32, device).cpu()
    return both[:, :R], both[:, R], lps, both[:, R + 1].bool()


# ---- multi-turn samples ------------------------------------------------------------------------------
@dataclass
class TurnOutcome:
    """The episodes of one partial generation's rows, the same on every rank (the environment
    instances only on the ranks that generated): each row's ``EpisodeState``, the generation's
    episode counts (``env_turns.gather_episode_counts``) and the replayed episodes whose observations the
    replay did not reproduce."""

    states: List[EpisodeState]
    counts: Dict[str, float]
    replay_mismatches: int = 0


def replay_episodes(make_turns: Callable, prompts: List[List[int]], records: List[dict], tokens: List[List[int]],
                    episodes: List[EpisodeState]) -> Tuple[List[EpisodeState], int]:
    """The episodes with the instance of each one loaded from a checkpoint (``restored``) rebuilt:
    its recorded turns stepped in order on a fresh instance (``make_turns(prompts, records)``: an
    ``env_turns.EpisodeTurns``, whose first step resets it with the record), as the decode loop
    stepped them; and how many replays gave another observation than the recorded one."""
    todo = [i for i, e in enumerate(episodes) if e is not None and e.restored]
    if not todo:
        return episodes, 0
    turns = make_turns([prompts[i] for i in todo], [records[i] for i in todo])
    differ = set()
    for k in range(max(len(episodes[i].spans) for i in todo)):
        rows = [j for j, i in enumerate(todo) if len(episodes[i].spans) > k]
        spans = [episodes[todo[j]].spans[k] for j in rows]
        answers = turns.step(rows, [tokens[todo[j]][a:b] for j, (a, b) in zip(rows, spans)],
                             [tokens[todo[j]][:a] for j, (a, _) in zip(rows, spans)], [False] * len(rows))
        for j, (_, end), obs in zip(rows, spans, answers):
            e = episodes[todo[j]]
            until = e.spans[k + 1][0] if k + 1 < len(e.spans) else e.turn_start
            if obs is None or list(obs) != list(tokens[todo[j]][end:until]):
                differ.add(j)
    out = list(episodes)
    for j, i in enumerate(todo):
        out[i] = replace(episodes[i], env=turns.envs[j], restored=False)
    return out, len(differ)


def gather_turns(turns, out, layout, rows: int, device: torch.device, replayed: int) -> TurnOutcome:
    """Every rank's ``TurnOutcome`` of one partial generation (``turns``: the generating rank's
    ``EpisodeTurns``, ``out`` its GenerationOutput; None elsewhere)."""
    from puzzle.parallel.device import runtime

    counts = gather_episode_counts(turns, out, layout, device)
    local = None
    if turns is not None:
        lengths = out.response_lengths.tolist()
        local = [EpisodeState(out.observation_mask[r, :lengths[r]].cpu().clone(), list(turns.spans[r]),
                              out.turn_states[r].turn_start, turns.rewards[r], list(turns.turn_ends[r]),
                              turns.last_error[r]) for r in range(rows)]
    states, replayed = runtime().broadcast_object((local, replayed), src=layout.plan.generation_owners()[0])
    if turns is not None:  # the instances stay where they step
        states = [replace(s, env=env) for s, env in zip(states, turns.envs)]
    return TurnOutcome(states, counts, replayed)


def episode_results(taken: List[PartialSample], outcome: Optional[TurnOutcome], max_new: int,
                    device: torch.device) -> EpisodeResults:
    """The batch's episodes: each sample's score (the sum of its rewards; 0.0 without one, bad when
    its last step failed) and per-turn reward columns. Counts: the turns, tool calls (turns answered
    by an observation) and observation tokens of the taken samples (over all the iterations that
    generated them: per trained sample as without partial rollouts); the events (step errors,
    timeouts, cuts, truncated observations) of this iteration's generation (none when every taken
    sample finished before it)."""
    scores, bad = torch.zeros(len(taken)), torch.zeros(len(taken), dtype=torch.bool)
    per_turn = torch.zeros(len(taken), max_new, dtype=torch.float64)  # summed as gather_episodes sums them
    counts = {k: (outcome.counts.get(k, 0) if outcome is not None else 0)
              for k in ("turn_limit_cuts", "token_limit_cuts", "observations_truncated", "env_step_errors",
                        "env_step_timeouts")}
    counts.update(turns=0, tool_calls=0, observation_tokens=0)
    for b, s in enumerate(taken):
        e = s.episode
        scores[b] = e.reward if e.reward is not None else 0.0
        bad[b] = e.reward is None and e.last_error is not None
        for col, reward in e.turn_rewards:
            per_turn[b, col] += reward
        counts["turns"] += len(e.spans)
        counts["tool_calls"] += sum(1 for _, end in e.spans if end < len(e.observation) and bool(e.observation[end]))
        counts["observation_tokens"] += int(e.observation.sum())
    return EpisodeResults(scores.to(device), bad.to(device), counts, per_turn.float().to(device))
