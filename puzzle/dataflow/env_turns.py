"""Multi-turn episodes of ``--env`` (``--max-turns`` > 1): the decode loop's turn handler
(puzzle/rollout/turns.py ``TurnHandler``) over the environment's worker pool.

One episode per generated row: each ended turn is decoded once to text (the environment reads
text; the sequence keeps the token ids as sampled), stepped in the pool under its timeout, and
the observation encoded, capped at ``--max-observation-tokens`` with the truncation marker, and
handed back to be inserted. With prompts in a chat family's template (``tool_format``,
puzzle/reward_functions/tool_formats.py) the observation is wrapped in the family's tool response
(the tokens that close the model's turn, hold the observation as a tool message and open the
model's next turn; each part encoded on its own, the wrapper not counted in the cap). A step that
failed shows the model an error observation (the episode keeps its instance as it was before that
step) and is counted by the runner.

A row's score is the sum of the rewards its episode gave (0.0 when it gave none; each reward also
at the last token of its turn: ``turn_rewards``, for GAE); an episode whose last step failed and
that gave no reward is a bad reward (``--on-bad-reward``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from puzzle.reward_functions.env_runner import EnvRunner, error_observation
from puzzle.reward_functions.environments import TRUNCATION_MARKER, EnvCall, Turn, cap_observation
from puzzle.reward_functions.runner import Result


class EpisodeTurns:
    """The episodes of one ``generate`` call's rows (``prompts[r]``, ``records[r]``)."""

    def __init__(self, runner: EnvRunner, tokenizer, prompts: List[List[int]], records: List[dict],
                 max_turns: int, max_observation_tokens: int, stops: List[List[int]], tool_format=None,
                 overlap_calls: int = 0):
        self.runner, self.tokenizer = runner, tokenizer
        # the decode loop's join rule (puzzle/rollout/turns.py): a step has this many model calls
        # of the other rows before its row waits for it; in worker processes the steps run in a
        # background thread from their submission (an in-process environment: at the join)
        self.overlap_calls = overlap_calls
        self.steps_in_background = runner.in_workers
        self.prompts, self.records = prompts, records
        self.max_turns, self.max_observation_tokens, self.stops = max_turns, max_observation_tokens, stops
        self.marker = tokenizer.encode(TRUNCATION_MARKER)
        self.tool_format = tool_format  # tool_formats.ToolFormat: prompts in a chat family's template
        self.wrapper = None if tool_format is None else (tokenizer.encode(tool_format.response_open),
                                                         tokenizer.encode(tool_format.response_close))
        self.stop_ids = set(tokenizer.eos_ids) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())
        n = len(prompts)
        self.envs: List[object] = [None] * n
        self.rewards: List[Optional[float]] = [None] * n
        self.turn_ends: List[List[tuple]] = [[] for _ in range(n)]  # (response column, reward) of each reward
        self.last_error: List[Optional[str]] = [None] * n
        # response columns [start, end) of each turn stepped; their count is the next turn's index
        self.spans: List[List[tuple]] = [[] for _ in range(n)]
        self.counts: Dict[str, int] = {"tool_calls": 0, "observations_truncated": 0}
        self.stats_before = dict(runner.stats)  # the runner counts over the run: this generation's are the rise

    def step(self, rows: List[int], turns: List[List[int]], histories: List[List[int]],
             final: List[bool]) -> List[Optional[List[int]]]:
        calls = []
        for r, turn, history in zip(rows, turns, histories):
            text_ids = [t for t in turn if t not in self.stop_ids]
            context = list(self.prompts[r]) + list(history)
            step = Turn(self.tokenizer.decode(text_ids), list(turn), len(self.spans[r]), self.tokenizer.decode(context),
                        context)
            calls.append(EnvCall(r, self.records[r], step, env=self.envs[r]))
            self.spans[r].append((len(history), len(history) + len(turn)))
        out: List[Optional[List[int]]] = []
        for r, is_final, turn, history, (outcome, why) in zip(rows, final, turns, histories, self.runner.step(calls)):
            self.last_error[r] = why
            if why is not None:
                observation, done = error_observation(why), False
            else:
                self.envs[r] = outcome.env
                if outcome.step.reward is not None:
                    self.rewards[r] = (self.rewards[r] or 0.0) + outcome.step.reward
                    self.turn_ends[r].append((len(history) + len(turn) - 1, outcome.step.reward))
                observation, done = outcome.step.observation, outcome.step.done
            if done:
                out.append(None)
                continue
            self.counts["tool_calls"] += not is_final
            ids, cut = cap_observation(self.tokenizer.encode(observation), self.max_observation_tokens, self.marker)
            self.counts["observations_truncated"] += cut
            out.append(ids if self.wrapper is None else self.wrapper[0] + ids + self.wrapper[1])
        return out

    def resume(self, r: int, episode) -> None:
        """Row r continues a carried episode (a partial rollout's ``partial.EpisodeState``): its
        instance, rewards, last error and turns so far."""
        self.envs[r], self.rewards[r], self.last_error[r] = episode.env, episode.reward, episode.last_error
        self.turn_ends[r], self.spans[r] = list(episode.turn_rewards), list(episode.spans)

    def turn_rewards(self, max_new: int):
        """[rows, max_new] float64: each step's reward at the response column of its turn's last token."""
        import torch

        out = torch.zeros(len(self.turn_ends), max_new, dtype=torch.float64)
        for r, ends in enumerate(self.turn_ends):
            for col, reward in ends:
                out[r, col] += reward
        return out

    def scores(self) -> List[Result]:
        """Each row's episode score, or ``(None, why)`` for a bad one."""
        return [(0.0 if why is None else None, why) if reward is None else (reward, None)
                for reward, why in zip(self.rewards, self.last_error)]


def response_turns(ids: List[int], observation: List[bool], tokenizer) -> List[Dict[str, str]]:
    """A multi-turn response (its token ids, and which are observation tokens) as its turns in
    order, the model's and the environment's: ``[{"model": text}, {"observation": text}, ...]``
    (each run of tokens of one kind decoded on its own; special tokens such as EOS left out)."""
    out: List[Dict[str, str]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or observation[i] != observation[start]:
            out.append({"observation" if observation[start] else "model": tokenizer.decode(ids[start:i])})
            start = i
    return out


#: the episode counts a generation reports (EpisodeResults.counts)
EPISODE_COUNT_KEYS = ("turns", "observation_tokens", "turn_limit_cuts", "token_limit_cuts", "tool_calls",
                      "observations_truncated", "env_step_errors", "env_step_timeouts")


def row_turns(batch, b: int, tokenizer) -> Dict[str, object]:
    """Row b of a multi-turn batch (its ``loss_mask`` 0 on observation tokens) for a sample log:
    its ``turns`` (:func:`response_turns`), ``tool_calls`` (turns answered by an observation) and
    ``observation_tokens``."""
    p, n = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
    obs = (batch.loss_mask[b, :n] == 0).tolist()
    turns = response_turns(batch.tokens[b, p:p + n].tolist(), obs, tokenizer)
    return {"turns": turns, "tool_calls": sum(1 for t in turns if "observation" in t), "observation_tokens": sum(obs)}


def gather_episode_counts(turns: Optional[EpisodeTurns], out, layout, device) -> Dict[str, float]:
    """The episodes' counts of one generation summed over the replicas, on every rank (the
    generation owners' copies: at T > 1 only the TP group's first rank stepped the episodes)."""
    import torch
    import torch.distributed as dist

    counts = None
    me = dist.get_rank() if dist.is_initialized() else 0
    if turns is not None and me in layout.plan.generation_owners():  # one copy of each replica's counts
        found = {**out.turn_counts, **turns.counts, **turns.runner.stats}
        counts = [found.get(k, 0) - turns.stats_before.get(k, 0) for k in EPISODE_COUNT_KEYS]
    total = torch.tensor(counts or [0] * len(EPISODE_COUNT_KEYS), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return dict(zip(EPISODE_COUNT_KEYS, total.tolist()))


def gather_episodes(turns: Optional[EpisodeTurns], out, layout, rows: int, device,
                    max_new: int) -> "EpisodeResults":
    """Every row's episode score, bad flag and per-turn rewards ([rows, max_new]), and the
    episodes' counts summed (:func:`gather_episode_counts`), on every rank, from the ranks that
    generated (``out``/``turns`` of this rank's share, None off the layout; at T > 1 only the TP
    group's first rank stepped the episodes: the owners' copies are read)."""
    import torch
    import torch.distributed as dist

    from puzzle.dataflow.batch import world_rows

    local = None
    me = dist.get_rank() if dist.is_initialized() else 0
    if turns is not None and me in layout.plan.generation_owners():
        local = torch.tensor([[v if v is not None else 0.0, float(why is not None)] for v, why in turns.scores()],
                             dtype=torch.float64)
    both = world_rows(local, layout.plan.generation_owners(), rows, (2,), torch.float64, device)
    per_turn = world_rows(turns.turn_rewards(max_new) if turns is not None else None,
                          layout.plan.generation_owners(), rows, (max_new,), torch.float64, device)
    counts = gather_episode_counts(turns, out, layout, device)
    return EpisodeResults(both[:, 0].float(), both[:, 1] > 0, counts, per_turn.float())


class EpisodeResults:
    """The episodes of one generation: ``scores`` [B], ``bad`` [B], the counts (summed) and
    ``turn_rewards`` [B, R] (each step's reward at its turn's last token; their row sums are the
    scores of the rows that are not bad)."""

    def __init__(self, scores, bad, counts: Dict[str, float], turn_rewards=None):
        self.scores, self.bad, self.counts, self.turn_rewards = scores, bad, counts, turn_rewards

    def metrics(self, rows: int) -> Dict[str, float]:
        c = self.counts
        return {"env_turns_per_sample": c["turns"] / rows, "env_tool_calls_per_sample": c["tool_calls"] / rows,
                "env_observation_tokens_per_sample": c["observation_tokens"] / rows,
                "env_step_errors": int(c["env_step_errors"]), "env_step_timeouts": int(c["env_step_timeouts"]),
                "env_turn_limit_cuts": int(c["turn_limit_cuts"]), "env_token_limit_cuts": int(c["token_limit_cuts"]),
                "env_observations_truncated": int(c["observations_truncated"])}
