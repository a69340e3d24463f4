"""Iteration metrics: a Megatron-style log line, DIR/metrics.jsonl, TensorBoard when installed."""

from __future__ import annotations

import json
import math
import os
from typing import Optional


class MetricsLogger:
    def __init__(self, log_dir: Optional[str], log_interval: int, train_iters: int, rank: int):
        self.rank, self.log_interval, self.train_iters = rank, log_interval, train_iters
        self.file = None
        self.tb = None
        if rank == 0 and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "metrics.jsonl"), "a")
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def log(self, metrics: dict) -> None:
        if self.rank != 0:
            return
        it = metrics["iteration"]
        if self.file:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "iteration" and math.isfinite(v):
                    self.tb.add_scalar(k, v, it)
        if it % self.log_interval == 0 or it == self.train_iters:
            parts = [f" iteration {it:8d}/{self.train_iters:8d}",
                     f"reward: {metrics['reward_mean']:.4f}", f"kl: {metrics['kl']:.5f}",
                     f"policy loss: {metrics['policy_loss']:.4E}", f"value loss: {metrics['value_loss']:.4E}",
                     f"clip frac: {metrics['clip_frac']:.3f}", f"entropy: {metrics['entropy']:.3f}",
                     f"resp len: {metrics['response_length_mean']:.1f}",
                     f"samples/s: {metrics['samples_per_sec']:.2f}",
                     f"time gen/score/train (s): {metrics['time_generate']:.2f}/"
                     f"{metrics['time_score']:.2f}/{metrics['time_train']:.2f}"]
            if "reward_group_std_mean" in metrics:  # group sampling (--n-samples-per-prompt > 1)
                parts.insert(2, f"solved: {metrics['solved_fraction']:.3f}")
            if metrics.get("bad_rewards"):
                parts.insert(2, f"bad rewards: {metrics['bad_rewards']}")
            print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
