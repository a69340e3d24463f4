"""Evaluation on held-out prompts during training (``--eval-prompts``, ``--eval-interval``,
``--eval-iters``, ``--eval-n-samples-per-prompt``; Megatron-LM's names, verl's ``test_freq`` and
``val_before_train``).

At iteration 0, every ``--eval-interval`` iterations and at the end, the actor answers the eval
prompts with the engine and layout of the generation stage (the shadow generation model when the
actor switches layouts): greedily, or N samples per prompt at the run's temperature. The run's
reward (function or model) scores them. With --rl-desired-lag the generation pool generates them
with the weights of that iteration (sent to it after the iteration's step) and the training pool
scores them (``source``). Metrics go under ``eval/`` into every metrics sink:

- ``eval/reward``: mean score; ``eval/response_length``: mean response tokens;
- with a reward function (a verifiable reward): ``eval/accuracy``, the fraction of samples scoring
  >= 1 (a correct answer, as ``solved_fraction`` counts it), and with N > 1 ``eval/pass@k``
  (the unbiased estimator of Chen et al. 2021) for k = 2, 4, ... and N;
- ``time_eval`` (seconds, a machine field);
- multi-turn (``--env`` with ``--max-turns`` > 1): the eval samples are episodes run as training
  runs them (the decode loop steps the environment, observations inserted), scored by their
  episodes; also ``eval/env_turns_per_sample``, ``eval/env_tool_calls_per_sample``,
  ``eval/env_observation_tokens_per_sample`` and the counts of step errors, timeouts, cuts and
  truncated observations (``env_turns.EpisodeResults.metrics``; the counts include the fill rows
  of a batch, which are generated like the others).

The samples go to DIR/eval_samples.jsonl. Evaluation reads no training RNG and no training data:
its sampling noise is keyed by its own seed (puzzle.rollout.sampling is counter-based), its prompts
come from their own file, so the training metrics are those of the same run without it.
"""

from __future__ import annotations

import math
import time
from typing import List, Optional

import torch

#: the eval sampling seed is the training one's plus this: the two never share noise
EVAL_SEED_OFFSET = 1 << 40


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n samples, of
    which ``correct`` are correct, is correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n (got n={n}, correct={correct}, k={k})")
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod((n - correct - i) / (n - i) for i in range(k))


def pass_at_k_values(n: int) -> List[int]:
    """The k of the pass@k metrics for n samples per prompt: 2, 4, 8, ... below n, and n (none for 1)."""
    if n < 2:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def evaluation_due(iteration: int, interval: Optional[int], train_iters: int) -> bool:
    """At iteration 0, every ``interval`` iterations (None: none between) and at the last."""
    return iteration == 0 or iteration == train_iters or bool(interval) and iteration % interval == 0


def eval_batches(n_prompts: int, batch_prompts: int, iters: Optional[int]) -> List[range]:
    """Consecutive batches of ``batch_prompts`` prompt indices: ``iters`` of them, or (None) as many
    as cover every prompt, the last one possibly shorter."""
    if iters is not None and iters * batch_prompts > n_prompts:
        raise ValueError(f"--eval-iters {iters} batches of --rollout-batch-size {batch_prompts} prompts need "
                         f"{iters * batch_prompts} prompts; --eval-prompts has {n_prompts}")
    end = n_prompts if iters is None else iters * batch_prompts
    return [range(s, min(s + batch_prompts, end)) for s in range(0, end, batch_prompts)]


def summarize(scores: torch.Tensor, lengths: torch.Tensor, with_accuracy: bool) -> dict:
    """eval/ metrics of [prompts, samples] scores and response lengths."""
    n_prompts, n = scores.shape
    out = {"eval/reward": float(scores.double().mean())}
    if with_accuracy:
        correct = scores >= 1.0
        out["eval/accuracy"] = float(correct.double().mean())
        counts = correct.sum(dim=1).tolist()
        for k in pass_at_k_values(n):
            out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / n_prompts
    out.update({"eval/response_length": float(lengths.double().mean()), "eval/prompts": int(n_prompts)})
    return out


def _padded(rows: int, unit: int) -> int:
    return -(-rows // unit) * unit


class Evaluator:
    """Evaluates the actor on ``dataset`` (a PromptDataset of the eval prompts) through the run's
    own stages: ``generation`` (its engine and layout, its sampling) and the scoring path
    (``rewards``'s function, else ``scoring``'s reward model, checked by ``rewards``).
    Call on every rank; every rank gets the same metrics, rank 0 writes the samples."""

    def __init__(self, cfg, tokenizer, dataset, generation, scoring, rewards, runtime, rank: int,
                 resumed_from: int = 0):
        from puzzle.metrics import SampleLog

        self.cfg, self.tokenizer, self.dataset = cfg, tokenizer, dataset
        self.generation, self.scoring, self.rewards, self.runtime = generation, scoring, rewards, runtime
        ev = cfg.evaluation
        self.n = ev.samples_per_prompt
        self.batches = eval_batches(len(dataset.prompts), cfg.ppo.rollout_batch_size, ev.iters)
        self.samples = SampleLog(cfg.log_dir, 1, rank, resumed_from, "eval_samples.jsonl") if cfg.log_dir else None
        self.rank = rank
        # where the eval batches come from: ``generate`` here, or (--rl-desired-lag, the training
        # pool) a function of the iteration receiving those the generation pool generated
        self.source = None
        self.episodes: list = []  # multi-turn: each eval batch's episodes (``generate``)

    def due(self, iteration: int) -> bool:
        return evaluation_due(iteration, self.cfg.evaluation.interval, self.cfg.train_iters)

    def __call__(self, iteration: int) -> dict:
        t0 = time.perf_counter()
        multi_turn = self.rewards.multi_turn  # episodes of --env in the decode loop, as in training
        self.episodes = []
        batches = (self.source or self.generate)(iteration)
        scores, lengths, bad, counts, generated = [], [], 0, {}, 0
        for k, (rows, batch) in enumerate(zip(self.batches, batches)):
            records = self._records(rows, batch.size)
            keep = len(rows) * self.n
            if multi_turn:
                episodes = self.episodes[k]
                batch_scores, batch_bad = self._episode_scores(episodes, iteration, keep)
                counts = {c: counts.get(c, 0) + v for c, v in episodes.counts.items()}
                generated += batch.size
            else:
                batch_scores, batch_bad = self._score(batch, records, iteration, keep)
            scores.append(batch_scores.cpu())
            lengths.append(batch.response_lengths[:keep].cpu())
            bad += batch_bad
            self._write_samples(batch, records, list(rows), batch_scores, iteration)
        metrics = summarize(torch.cat(scores).view(-1, self.n), torch.cat(lengths).view(-1, self.n),
                            with_accuracy=self.rewards.function is not None)
        if bad:
            metrics["eval/bad_rewards"] = bad
        if multi_turn:
            from puzzle.dataflow.env_turns import EpisodeResults

            metrics.update({"eval/" + k: v for k, v in EpisodeResults(None, None, counts).metrics(generated).items()})
        self.runtime.synchronize()
        metrics["time_eval"] = time.perf_counter() - t0
        return metrics

    def generate(self, iteration: int) -> list:
        """The eval batches of ``iteration`` (one per entry of ``batches``, filled to the layouts'
        shares), generated by the generation stage's engine; multi-turn, each batch's episodes
        (``env_turns.EpisodeResults``) in ``episodes``."""
        engine = self.generation.engine()
        out, offset = [], 0
        multi_turn = self.rewards.multi_turn
        for rows in self.batches:
            ids = [self.dataset.prompts[i] for i in rows for _ in range(self.n)]
            size = _padded(len(ids), self._unit(engine))
            ids = ids + [ids[0]] * (size - len(ids))  # rows to fill the layouts' shares, dropped after
            out.append(self.generation.sample(engine, ids, seed=self.cfg.seed * 100003 + iteration + EVAL_SEED_OFFSET,
                                              greedy=self.n == 1 or self.cfg.ppo.greedy, first_sample=offset,
                                              records=self._records(rows, size) if multi_turn else None))
            if multi_turn:
                self.episodes.append(self.generation.episodes)
            offset += size
        return out

    def _records(self, rows, size: int) -> List[dict]:
        """The records of an eval batch's rows (``n`` per prompt), filled to ``size`` rows with
        the first one's (the fill rows, dropped after)."""
        records = [self.dataset.records[i] if self.dataset.records else {} for i in rows for _ in range(self.n)]
        return records + [records[0]] * (size - len(records))

    def _unit(self, engine) -> int:
        """Rows of an eval batch are a multiple of this: the generation layout's D, and the reward
        model's D x micro-batch when a reward model scores."""
        unit = engine.layout.plan.D
        reward_plan = self.cfg.roles["reward"].plan if "reward" in self.cfg.roles else None
        if reward_plan is not None:
            unit = math.lcm(unit, reward_plan.D * self.cfg.ppo.micro_batch_size)
        return unit

    def _score(self, batch, records: List[dict], iteration: int, keep: int):
        """The run's reward for the first ``keep`` rows (the fill rows after them are neither
        scored by a function nor counted as bad): its reward function, else its reward model
        (each checked by the run's ``Rewards``, the eval rows' scores kept out of the rollout's
        state)."""
        if self.rewards.function is not None:
            scores, bad = self.rewards.function_scores(batch, records, keep, iteration, "eval sample")
            return scores.float(), bad
        scores = self.scoring.reward_model_scores(batch)[:keep]
        return self.rewards.check_model_scores(scores.float(), iteration, " (eval)")

    def _episode_scores(self, episodes, iteration: int, keep: int):
        """Multi-turn: the first ``keep`` rows' episode scores (``env_turns.EpisodeResults``), bad
        ones replaced or refused as in training (the fill rows after them not counted)."""
        from puzzle.dataflow.env_turns import EpisodeResults

        kept = EpisodeResults(episodes.scores[:keep], episodes.bad[:keep], episodes.counts)
        scores, bad = self.rewards.episode_scores(kept, iteration)
        return scores.float(), bad

    def _write_samples(self, batch, records, prompt_indices, scores, iteration: int) -> None:
        if self.samples is None or self.samples.file is None:
            return
        from puzzle.dataflow.env_turns import row_turns
        from puzzle.dataflow.reward_stage import batch_samples

        samples = batch_samples(batch, self.tokenizer, records, 0, len(prompt_indices) * self.n)
        rows = []
        for j, index in enumerate(prompt_indices):
            for k in range(self.n):
                s = samples[j * self.n + k]
                row = {"iteration": iteration, "index": index, "sample": k, "prompt": s.prompt_text,
                       "response": s.response_text, "reward": float(scores[j * self.n + k])}
                if "answer" in s.record:
                    row["answer"] = s.record["answer"]
                if getattr(batch, "loss_mask", None) is not None:  # multi-turn: the turns, as training logs them
                    row.update(row_turns(batch, j * self.n + k, self.tokenizer))
                rows.append(row)
        self.samples.write(rows)

    def close(self) -> None:
        if self.samples is not None:
            self.samples.close()
