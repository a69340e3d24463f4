"""The generation stage with --rl-partial-rollouts (puzzle/rollout/partial.py has the mechanics).

Each iteration serves ``ceil(oversample x G)`` groups (G: the batch's prompts): the carried groups
first, oldest first, then fresh prompts in data order (the iteration's, then more from the
loader when short). Generation stops once G whole groups have finished; the first G finished
groups in serving order are the batch, and every other sample (running, waiting, or finished in a
group not taken) goes back to the buffer with its tokens, their log-probs as sampled and the
policy version of each token. A carried sample resumes by a prefill of prompt + partial response
under the run-wide seed and its own global sample index (prompt index x N + sample index), so its
noise stream continues where it stopped.

The policy version of the weights that generate at iteration ``it`` is ``it - 1`` (the
iterations trained before). Everything here is collective and ends identical on every rank: the
one generating share's rows are handed to all ranks before the buffer is updated.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from puzzle.dataflow.batch import RolloutBatch, right_padded_rows, world_rows
from puzzle.rollout.partial import GroupQuota, PartialRolloutBuffer, PartialSample, staleness


def seed_of_run(cfg) -> int:
    """The generation seed of every iteration with partial rollouts (run-wide: a carried sample
    keeps its noise stream across iterations)."""
    return cfg.seed * 100003


class PartialRollouts:
    """The buffer of carried samples, the prompts they belong to and the fresh prompts not served
    yet (all checkpointed: ``state_dict``)."""

    def __init__(self, cfg, tokenizer, device: torch.device, seq_multiple: int = 1):
        self.cfg, self.ppo, self.tokenizer = cfg, cfg.ppo, tokenizer
        self.device, self.seq_multiple = device, seq_multiple
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
        new = [PartialSample(p, j, p * N + j, seed, version, torch.zeros(0, dtype=torch.long),
                             torch.zeros(0), torch.zeros(0, dtype=torch.long)) for p in fresh for j in range(N)]
        return order + fresh, carried + new

    def run(self, engine, sample_fn, prompt_ids, records, refill: Optional[Callable], iteration: int):
        """(batch, records, per-token versions [B, R] (-1 after a response), sample ids, stats).
        ``sample_fn(engine, rows, partial_tokens, partial_logprobs, sample_ids, stop)`` -> every
        rank's (responses [b, R], lengths [b], logprobs [b, R], finished [b])."""
        N, G = self.ppo.n_samples_per_prompt, len(prompt_ids)
        version = iteration - 1
        order, samples = self.serve(prompt_ids, records, refill, version)
        position = {p: k for k, p in enumerate(order)}
        todo = [i for i, s in enumerate(samples) if not s.finished]
        open_groups = {s.prompt_index for s in samples if not s.finished}
        done_before = sum(1 for p in order if p not in open_groups)  # every sample finished earlier
        if todo and G > done_before:
            rows = [samples[i] for i in todo]
            quota = GroupQuota(tuple(position[s.prompt_index] for s in rows), G - done_before)
            resp, lengths, lps, finished = sample_fn(engine, [self.prompts[s.prompt_index][0] for s in rows],
                                                     [s.tokens.tolist() for s in rows], [s.logprobs for s in rows],
                                                     [s.sample_id for s in rows], quota)
            for k, i in enumerate(todo):
                n = int(lengths[k])
                samples[i] = samples[i].extended(resp[k, :n], lps[k, :n], version, bool(finished[k]))
        taken, kept = self._split(order, samples, G)
        self.buffer.put(kept)
        batch, versions = self._batch(taken)
        stats = staleness([s.versions for s in taken], version)
        stats.update(partial_groups_served=len(order), partial_buffer_samples=len(self.buffer))
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

    def _batch(self, taken: List[PartialSample]) -> Tuple[RolloutBatch, torch.Tensor]:
        """The world's batch of the taken samples (the behaviour log-probs as ``gen_logprobs``) and
        each token's policy version."""
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
        return RolloutBatch(tokens, prompt_lengths.to(dev), lengths.to(dev), R,
                            gen_logprobs=logprobs.to(dev)), versions

    # ---- checkpoints (trainer_state.json: plain lists) ---------------------------------------
    def state_dict(self) -> dict:
        buf = {k: v.tolist() for k, v in self.buffer.state_dict().items()}
        return {"buffer": buf, "prompts": [[p, ids, rec] for p, (ids, rec) in sorted(self.prompts.items())],
                "pending": list(self.pending), "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        dtypes = {"finished": torch.bool, "logprobs": torch.float32}
        self.buffer.load_state_dict({k: torch.tensor(v, dtype=dtypes.get(k, torch.long))
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
