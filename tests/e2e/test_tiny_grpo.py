"""End-to-end tiny GRPO run (examples/run_grpo_tiny.sh, 1 rank, 40 iterations): the actor learns
the bundled one-digit sums from the verifiable reward, with no critic and no reference built."""

import json
import math

import pytest

from tests.harness import TINY_GRPO, assert_same_metrics, read_metrics, run_script, run_world


def _grpo(args, log_dir, check=True):
    return run_script(TINY_GRPO, args, log_dir, nproc=1, check=check)


def test_running_reward_normalisation_resumes_exactly():
    """rloo (not invariant to the score scale) with running moments: a run resumed at iteration 2
    repeats iterations 3-4 of the uninterrupted run exactly, moments included. Both runs are
    trainers in one 1-rank world (worlds/tiny_runs.py), the second loading the first's checkpoint."""
    res = run_world("distributed/worlds/tiny_runs.py", 1)[0]["grpo_resume"]
    straight, resumed = res["straight"], res["resumed"]
    assert [r["iteration"] for r in straight] == [1, 2, 3, 4]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_same_metrics(resumed, straight, ("reward_norm_mean", "reward_norm_std", "policy_loss",
                                            "actor_grad_norm", "reward_mean"), iterations=(3, 4))
    assert straight[3]["reward_norm_std"] != straight[0]["reward_norm_std"]


def test_bad_reward_error_stops_the_run(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+0=", "value": "raise" if i == 5 else 1.0}) + "\n"
                            for i in range(8)))
    args = ["--prompt-data", str(data), "--reward-fn", "tests.unit.reward_fixtures:batched_by_record",
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "2", "--micro-batch-size", "16", "--train-iters", "2",
            "--eval-iters", "0"]  # the script's held-out sums have no "value" for this reward
    proc, _ = _grpo(args + ["--on-bad-reward", "error"], tmp_path / "a", check=False)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "of iteration 1 raised RuntimeError: boom" in proc.stderr and "--on-bad-reward error" in proc.stderr
    # a clean stop: no worker traceback (torchrun itself reports the non-zero exit), no dead peers
    assert "reward_functions/distributed.py" not in proc.stderr and "Connection closed" not in proc.stderr
    # default: two worker processes score a chunk of 8 samples each; the chunk with prompt 5 fails
    proc, rows = _grpo(args + ["--bad-reward-value", "-1", "--reward-workers", "2"], tmp_path / "b")
    assert proc.stderr.count("warning: --reward-fn tests.unit.reward_fixtures:batched_by_record") == 1
    assert [r["bad_rewards"] for r in rows] == [8, 8]
    assert all(math.isfinite(r["policy_loss"]) and r["reward_mean"] == 0.0 for r in rows)  # (8 x 1 + 8 x -1) / 16


@pytest.mark.learning
@pytest.mark.launch_ahead(TINY_GRPO, ["--train-iters", "40"], 1)
def test_tiny_grpo_solve_rate_rises(ahead):
    """The learning run (1 rank, 40 iterations), launched ahead (tests/conftest.py)."""
    proc = ahead.finish(timeout=900)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0 and "terminate called" not in err, (out + err)[-6000:]
    lines = read_metrics(ahead.log_dir)
    rows = [r for r in lines if r["iteration"] > 0]  # iteration 0: the evaluation before training
    assert len(rows) == 40
    for key in ("solved_fraction", "reward_std", "reward_group_std_mean", "response_length_p90",
                "response_clipped_frac", "bad_rewards", "groups_all_solved", "policy_loss", "actor_grad_norm"):
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    first = sum(r["solved_fraction"] for r in rows[:5]) / 5
    last = sum(r["solved_fraction"] for r in rows[-5:]) / 5
    assert first < 0.02 and last > first + 0.08, (first, last)  # chance is 1 byte in 259
    assert all(r["bad_rewards"] == 0 and "critic_grad_norm" not in r and "value_loss" not in r for r in rows)
    # held-out prompts (the sums after a space), greedy, at iterations 0, 20 (--eval-interval) and 40 (the end)
    evals = {r["iteration"]: r["eval/accuracy"] for r in lines if "eval/accuracy" in r}
    assert sorted(evals) == [0, 20, 40] and evals[40] > evals[0], evals
    assert all(r["lr"] == 3e-3 for r in rows)
    samples = [json.loads(x) for x in (ahead.log_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 55 and {s["iteration"] for s in samples} == {0, 20, 40}
    assert sum(s["reward"] for s in samples if s["iteration"] == 40) == round(evals[40] * 55)
    plan = [line.split()[0] for line in out.splitlines() if "layout (" in line]
    assert plan == ["actor"], out[:2000]  # no critic, no reference (--kl-coef 0)
