"""Iteration metrics: a Megatron-style log line, DIR/metrics.jsonl, TensorBoard, Weights & Biases;
sampled rollout rows (``--log-samples``) in DIR/samples.jsonl.

``metrics.jsonl`` belongs to one run: the first iteration logged decides what is kept. A fresh run
(iteration 0 or 1) starts an empty file; a run resumed at iteration K keeps the lines of iterations
<= K (the run it continues) and appends after them, so a preempted and resumed job has one line
per iteration (and one for iteration 0 when it evaluates there: eval/ fields only).
``--tensorboard-dir`` and ``--wandb-project`` receive the same numbers.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import List, Optional

#: the roles' gradient norms in the log line, in this order (a run logs those of the roles it builds)
GRAD_NORMS = (("actor_grad_norm", "actor"), ("critic_grad_norm", "critic"))


def open_run_jsonl(path: str, resumed_from: int):
    """``path`` opened for this run's lines: emptied for a fresh run (``resumed_from`` 0), else the
    lines of iterations <= ``resumed_from`` kept (the run this one continues; later ones belong to
    a run that was not saved, and a line cut by a kill is dropped)."""
    kept = []
    if resumed_from > 0 and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    if int(json.loads(line)["iteration"]) <= resumed_from:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue
    out = open(path, "w")
    out.writelines(kept)
    out.flush()
    return out


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def eta_seconds(elapsed: float, done: int, remaining: int) -> Optional[float]:
    """Time left at the mean pace of the ``done`` iterations so far; None before the first."""
    return elapsed / done * remaining if done > 0 else None


def format_iteration_line(m: dict, train_iters: int, elapsed: Optional[float] = None,
                          eta: Optional[float] = None) -> str:
    """The rank-0 line of one iteration; fields absent from ``m`` (roles the run does not build,
    metrics a run does not compute) are left out."""
    it = m["iteration"]
    parts = [f" iteration {it:8d}/{train_iters:8d}"]
    if elapsed is not None:
        parts.append(f"elapsed: {format_duration(elapsed)}")
    if eta is not None:
        parts.append(f"ETA: {format_duration(eta)}")
    if "lr" in m:
        parts.append(f"learning rate: {m['lr']:.3E}")
    if "critic_lr" in m and m["critic_lr"] != m.get("lr"):
        parts.append(f"critic learning rate: {m['critic_lr']:.3E}")
    parts.append(f"reward: {m['reward_mean']:.4f}")
    if m.get("bad_rewards"):
        parts.append(f"bad rewards: {m['bad_rewards']}")
    if "reward_group_std_mean" in m:  # group sampling (--n-samples-per-prompt > 1)
        parts.append(f"solved: {m['solved_fraction']:.3f}")
    optional = [("kl", "kl: {:.5f}"), ("policy_loss", "policy loss: {:.4E}"), ("value_loss", "value loss: {:.4E}"),
                ("clip_frac", "clip frac: {:.3f}"), ("entropy", "entropy: {:.3f}"),
                ("response_length_mean", "resp len: {:.1f}")]
    parts += [fmt.format(m[k]) for k, fmt in optional if k in m]
    norms = [(role, m[k]) for k, role in GRAD_NORMS if k in m]
    if norms:
        parts.append(f"grad norm {'/'.join(r for r, _ in norms)}: {'/'.join(f'{v:.3f}' for _, v in norms)}")
    if "tokens_per_sec" in m:
        parts.append(f"tokens/s: {m['tokens_per_sec']:.1f}")
    parts.append(f"samples/s: {m['samples_per_sec']:.2f}")
    parts.append(f"time gen/score/train (s): {m['time_generate']:.2f}/{m['time_score']:.2f}/{m['time_train']:.2f}")
    return " | ".join(parts)


def format_eval_line(m: dict) -> str:
    """The rank-0 line of an evaluation (the eval/ fields of ``m``)."""
    parts = [f" evaluation at iteration {m['iteration']}"]
    for key, value in m.items():
        if key.startswith("eval/"):
            name = key[len("eval/"):].replace("_", " ")
            parts.append(f"{name}: {value}" if isinstance(value, int) else f"{name}: {value:.4f}")
    if "time_eval" in m:
        parts.append(f"time (s): {m['time_eval']:.2f}")
    return " | ".join(parts)


def is_training_line(metrics: dict) -> bool:
    return "time_train" in metrics


class MetricsLogger:
    def __init__(self, log_dir: Optional[str], log_interval: int, train_iters: int, rank: int, ops=None):
        self.rank, self.log_interval, self.train_iters = rank, log_interval, train_iters
        self.log_dir, self.ops = log_dir, ops
        self.file = None
        self.tb = None
        self.wandb = None
        self._started = False
        self._clock = time.monotonic()  # the pace of this process's iterations (elapsed, ETA)
        self._first_iteration: Optional[int] = None

    def _start(self, first_iteration: int) -> None:
        """Open the sinks; the lines of iterations before ``first_iteration`` are the run this one
        continues (a resume), later ones belong to a run that was not saved: dropped."""
        self._started = True
        ops = self.ops
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            self.file = open_run_jsonl(os.path.join(self.log_dir, "metrics.jsonl"), max(first_iteration - 1, 0))
        if ops is not None and ops.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=ops.tensorboard_dir, purge_step=first_iteration)
        if ops is not None and ops.wandb_project:
            import wandb

            save_dir = ops.wandb_save_dir or self.log_dir
            self.wandb = wandb.init(project=ops.wandb_project, name=ops.wandb_exp_name,
                                    dir=save_dir, resume="allow" if first_iteration > 1 else None)

    def log(self, metrics: dict) -> None:
        if self.rank != 0:
            return
        it = metrics["iteration"]
        if not self._started:
            self._start(it)
        if self.file:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"
                   and math.isfinite(v)}
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, it)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(scalars, step=it)
        if is_training_line(metrics):
            if self._first_iteration is None:
                self._first_iteration = it
            if it % self.log_interval == 0 or it == self.train_iters:
                elapsed = time.monotonic() - self._clock
                eta = eta_seconds(elapsed, it - self._first_iteration + 1, self.train_iters - it)
                print(format_iteration_line(metrics, self.train_iters, elapsed, eta), flush=True)
        if any(k.startswith("eval/") for k in metrics):
            print(format_eval_line(metrics), flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def learning_rates(engines: dict, runtime) -> dict:
    """``lr`` (actor) and ``critic_lr``: the learning rate of each trainable role's optimizer now
    (after this iteration's scheduler steps, as Megatron-LM's log line reports it). Collective:
    the ranks outside a role's layout learn it from those inside."""
    roles = [(role, key) for role, key in (("actor", "lr"), ("critic", "critic_lr"))
             if role in engines and engines[role].trainable]
    mine = [float(engines[r].optimizer.param_groups[0]["lr"]) if engines[r].scheduler is not None else -1.0
            for r, _ in roles]
    return dict(zip((key for _, key in roles), runtime.all_reduce(mine, op="max")))


def sample_rows(count: int, size: int) -> List[int]:
    """``count`` rows of a batch of ``size``, spread evenly (the first of each stride): with group
    sampling they come from different prompts."""
    count = min(count, size)
    return [i * size // count for i in range(count)] if count else []


class SampleLog:
    """``--log-samples N``: N prompt/response/reward rows of each iteration's rollout in
    DIR/samples.jsonl (rank 0; a resumed run keeps the rows of the iterations it continues)."""

    def __init__(self, log_dir: str, count: int, rank: int, resumed_from: int, file_name: str = "samples.jsonl"):
        self.count = count
        self.file = None
        if rank == 0 and count > 0:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open_run_jsonl(os.path.join(log_dir, file_name), resumed_from)

    def write(self, rows: List[dict]) -> None:
        if self.file is None:
            return
        self.file.writelines(json.dumps(r) + "\n" for r in rows)
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class GenerationProgress:
    """A progress bar of one generation's responses (rank 0's share) on a terminal, through tqdm;
    ``label()`` names it (e.g. the iteration). Build it with ``for_terminal``: off the terminal
    (a log file, a Slurm job) there is none."""

    def __init__(self, label, stream):
        self.label, self.stream = label, stream
        self.bar = None

    @classmethod
    def for_terminal(cls, rank: int, label, stream=None) -> Optional["GenerationProgress"]:
        import sys

        stream = stream if stream is not None else sys.stdout
        return cls(label, stream) if rank == 0 and stream.isatty() else None

    def __call__(self, finished: int, rows: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=rows, desc=self.label(), unit="response", leave=False, file=self.stream,
                            dynamic_ncols=True)
        self.bar.update(finished - self.bar.n)
        if finished >= rows:
            self.bar.close()
            self.bar = None


def rollout_sample_rows(batch, tokenizer, iteration: int, count: int) -> List[dict]:
    """``count`` rows of a scored rollout batch (``sample_rows``) as JSON-ready dicts: the prompt
    and response texts (without EOS), the response length and the reward (the score before any
    shaping or normalisation); a multi-turn row also its ``turns`` (``[{"model": text},
    {"observation": text}, ...]``), its ``tool_calls`` (turns answered by an observation) and
    ``observation_tokens``."""
    from puzzle.dataflow.reward_stage import decode_rows

    picked = sample_rows(count, batch.size)
    rlens, scores = batch.response_lengths.tolist(), batch.scores.tolist()
    samples = decode_rows(batch.tokens[picked].cpu(), batch.prompt_lengths[picked].tolist(),
                          [rlens[b] for b in picked], tokenizer, [{} for _ in picked])
    rows = [{"iteration": iteration, "sample": b, "prompt": s.prompt_text, "response": s.response_text,
             "response_length": rlens[b], "reward": scores[b]} for b, s in zip(picked, samples)]
    if getattr(batch, "loss_mask", None) is not None:  # multi-turn: the turns and their observations
        from puzzle.dataflow.env_turns import row_turns

        for row, b in zip(rows, picked):
            row.update(row_turns(batch, b, tokenizer))
    return rows


def tokens_per_second(batch, metrics: dict) -> float:
    """Prompt and response tokens of the iteration's batch over its three stages' time."""
    seconds = metrics["time_generate"] + metrics["time_score"] + metrics["time_train"]
    return float((batch.prompt_lengths + batch.response_lengths).sum()) / max(seconds, 1e-9)


class StageClock:
    """The wall time of each stage of an iteration (``time_<stage>``, the accelerator synchronised
    at each stage's end) and, on an accelerator, the busiest rank's peak memory per stage
    (``mem_peak_gib_<stage>``, one collective in ``metrics``). Entering a stage tells
    ``progress(iteration, "<phase> stage")``."""

    def __init__(self, runtime, iteration: int, progress):
        self.runtime, self.iteration, self.progress = runtime, iteration, progress
        self.seconds, self.peaks = {}, {}
        self.start = time.perf_counter()

    def stage(self, name: str, phase: str):
        import contextlib

        @contextlib.contextmanager
        def timed():
            self.progress(self.iteration, f"{phase} stage")
            self.runtime.reset_peak_memory()
            t0 = time.perf_counter()
            yield
            self.runtime.synchronize()
            self.seconds[name] = time.perf_counter() - t0
            self.peaks[name] = self.runtime.peak_memory_bytes()

        return timed()

    def metrics(self, samples: int) -> dict:
        """Collective on an accelerator (the peaks' max over ranks)."""
        out = {"samples_per_sec": samples / (time.perf_counter() - self.start),
               **{f"time_{k}": v for k, v in self.seconds.items()}}
        if self.runtime.on_accelerator:
            peaks = self.runtime.all_reduce(list(self.peaks.values()), op="max")
            out.update({f"mem_peak_gib_{k}": v / 2 ** 30 for k, v in zip(self.peaks, peaks)})
        return out
