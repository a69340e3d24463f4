"""End-to-end tiny GRPO run (examples/run_grpo_tiny.sh, 1 rank, 40 iterations): the actor learns
the bundled one-digit sums from the verifiable reward, with no critic and no reference built."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), NPROC="1")


def test_tiny_grpo_solve_rate_rises(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "examples/run_grpo_tiny.sh"), "--train-iters", "40",
                           "--log-dir", str(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40
    for key in ("solved_fraction", "reward_std", "reward_group_std_mean", "response_length_p90",
                "response_clipped_frac", "bad_rewards", "groups_all_solved", "policy_loss", "actor_grad_norm"):
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    first = sum(r["solved_fraction"] for r in rows[:5]) / 5
    last = sum(r["solved_fraction"] for r in rows[-5:]) / 5
    assert first < 0.02 and last > first + 0.08, (first, last)  # chance is 1 byte in 259
    assert all(r["bad_rewards"] == 0 and r["critic_grad_norm"] == 0.0 for r in rows)
    plan = [line.split()[0] for line in proc.stdout.splitlines() if "layout (" in line]
    assert plan == ["actor"], proc.stdout[:2000]  # no critic, no reference (--kl-coef 0)


def test_unimportable_reward_fn_fails_before_allocation():
    proc = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--seq-length", "32", "--advantage-estimator", "grpo",
                           "--n-samples-per-prompt", "4", "--reward-fn", "my_rewards:score"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--reward-fn 'my_rewards:score': cannot import module 'my_rewards'" in proc.stderr
    proc = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--seq-length", "32", "--advantage-estimator", "grpo",
                           "--reward-fn", "puzzle.reward_functions.builtin:exact_match"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --n-samples-per-prompt: --advantage-estimator grpo" in proc.stderr
