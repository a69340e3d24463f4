"""Iteration metrics: a Megatron-style log line, DIR/metrics.jsonl, TensorBoard, Weights & Biases.

``metrics.jsonl`` belongs to one run: the first iteration logged decides what is kept. A fresh run
(iteration 1) starts an empty file; a run resumed at iteration K keeps the lines of iterations
<= K (the run it continues) and appends after them, so a preempted and resumed job has one line
per iteration. ``--tensorboard-dir`` and ``--wandb-project`` receive the same numbers.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional


class MetricsLogger:
    def __init__(self, log_dir: Optional[str], log_interval: int, train_iters: int, rank: int, ops=None):
        self.rank, self.log_interval, self.train_iters = rank, log_interval, train_iters
        self.log_dir, self.ops = log_dir, ops
        self.file = None
        self.tb = None
        self.wandb = None
        self._started = False

    def _start(self, first_iteration: int) -> None:
        """Open the sinks; the lines of iterations before ``first_iteration`` are the run this one
        continues (a resume), later ones belong to a run that was not saved: dropped."""
        self._started = True
        ops = self.ops
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            path = os.path.join(self.log_dir, "metrics.jsonl")
            kept = []
            if first_iteration > 1 and os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        try:
                            if int(json.loads(line)["iteration"]) < first_iteration:
                                kept.append(line if line.endswith("\n") else line + "\n")
                        except (ValueError, KeyError, TypeError):
                            continue  # a line cut by a kill
            self.file = open(path, "w")
            self.file.writelines(kept)
            self.file.flush()
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
        if it % self.log_interval == 0 or it == self.train_iters:
            parts = [f" iteration {it:8d}/{self.train_iters:8d}",
                     f"reward: {metrics['reward_mean']:.4f}", f"kl: {metrics['kl']:.5f}",
                     f"policy loss: {metrics['policy_loss']:.4E}", f"value loss: {metrics['value_loss']:.4E}",
                     f"clip frac: {metrics['clip_frac']:.3f}", f"entropy: {metrics['entropy']:.3f}",
                     f"resp len: {metrics['response_length_mean']:.1f}",
                     f"samples/s: {metrics['samples_per_sec']:.2f}",
                     f"time gen/score/train (s): {metrics['time_generate']:.2f}/"
                     f"{metrics['time_score']:.2f}/{metrics['time_train']:.2f}"]
            print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
