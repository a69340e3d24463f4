"""End-to-end tiny PPO runs (CPU, gloo): the README quick start, layout invariance, bad flags."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _run(args, nproc, log_dir, timeout=900):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "train_ppo.py"), *args, "--log-dir", str(log_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def _tiny_script(args, log_dir, timeout=900):
    proc = subprocess.run(["bash", str(REPO / "examples/run_ppo_tiny.sh"), *args, "--log-dir", str(log_dir)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout, [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_learns(tmp_path):
    """The README quick start: reward of the last 5 iterations clearly above the first 5."""
    stdout, rows = _tiny_script([], tmp_path)
    assert len(rows) == 24
    for key in ("iteration", "reward_mean", "kl", "policy_loss", "value_loss", "clip_frac", "entropy",
                "response_length_mean", "samples_per_sec", "time_generate", "time_score", "time_train"):
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.05, (first, last)
    assert max(r["kl"] for r in rows) < 2.0
    assert rows[0]["prompts_loaded"] == 64 and rows[0]["prompts_dropped"] == 0  # the bundled set
    last = next(line for line in stdout.splitlines() if line.startswith(" iteration       24/      24 | elapsed: "))
    assert "| ETA: 0:00:00 | learning rate: 2.000E-03 | reward: " in last and "grad norm actor/critic: " in last


SMALL = ["--train-iters", "2", "--greedy", "--rollout-batch-size", "8", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--max-new-tokens", "8"]
KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "clip_frac", "entropy", "value_mean",
        "return_mean", "response_length_mean", "actor_grad_norm", "critic_grad_norm")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy 2-iteration run: actor and reference at (2,1,2), critic at (1,2,2), sequential."""
    return _tiny_script(SMALL, tmp_path_factory.mktemp("reference"), timeout=600)[1]


def _same(a, b, iterations=2, rel=1e-5, abs_=1e-6):
    for key in KEYS:
        for it in range(iterations):
            assert a[it][key] == pytest.approx(b[it][key], rel=rel, abs=abs_), (key, it)


def test_layout_changes_no_numbers(tmp_path, reference):
    """The same greedy metrics at (1,1,1) on 1 rank as with the actor at (2,1,2) on 4 ranks."""
    one = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--critic-tensor-model-parallel-size", "1", "--critic-pipeline-model-parallel-size", "1"]
    proc = subprocess.run(["bash", str(REPO / "examples/run_ppo_tiny.sh"), *SMALL, *one,
                           "--log-dir", str(tmp_path / "a")], cwd=REPO, env=dict(ENV, NPROC="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    _same(a, reference, rel=1e-4, abs_=1e-5)


def test_switch_changes_no_numbers(tmp_path, reference):
    """The actor generating at (1,2,2) through the switch (overlapped with its optimizer step)."""
    _, c = _tiny_script(SMALL + ["--actor-gen-tensor-model-parallel-size", "2",
                                 "--actor-gen-pipeline-model-parallel-size", "1", "--switch-segments", "4",
                                 "--ranks-per-node", "2"], tmp_path, timeout=600)
    _same(c, reference)


def test_time_sharing_changes_no_numbers(tmp_path, reference):
    """Scoring (actor, ref, critic) and training (actor, critic) time-shared at P=2."""
    _, ts = _tiny_script(SMALL + ["--critic-pipeline-model-parallel-size", "2",  # all at (2,1,2)
                                  "--score-placement", "time-sharing", "--train-placement", "time-sharing"],
                         tmp_path, timeout=600)
    _same(ts, reference)


def test_disjoint_placement_changes_no_numbers(tmp_path, reference):
    """actor+ref on ranks 0-1, critic on ranks 2-3: the groups run concurrently (SMDD)."""
    _, dj = _tiny_script(SMALL + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                                  "--actor-data-parallel-size", "2", "--ref-data-parallel-size", "2",
                                  "--critic-rank-offset", "2", "--critic-data-parallel-size", "2",
                                  "--critic-tensor-model-parallel-size", "1",
                                  "--score-placement", "disjoint", "--train-placement", "disjoint"],
                         tmp_path, timeout=600)
    _same(dj, reference)


def test_plan_auto_runs_and_changes_no_numbers(tmp_path, reference):
    """--plan auto searches the layouts at start (bundled profile); the chosen plan runs."""
    stdout, auto = _tiny_script(SMALL + ["--plan", "auto"], tmp_path, timeout=600)
    assert stdout.startswith("plan: --actor-tensor-model-parallel-size")
    _same(auto, reference)


def test_reward_model_at_two_layouts(tmp_path):
    """Four models: a (random) reward model scores at (1,4,1) and at (2,1,2) with the same result."""
    base = SMALL + ["--reward-fn", "", "--reward-model", "random"]
    _, a = _tiny_script(base + ["--reward-tensor-model-parallel-size", "1",
                                "--reward-pipeline-model-parallel-size", "1"], tmp_path / "a", timeout=600)
    _, b = _tiny_script(base, tmp_path / "b", timeout=600)  # reward follows the actor: (2,1,2)
    _same(a, b)
    assert a[0]["reward_mean"] != 0.0


def test_bad_flags_fail_before_allocation():
    proc = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--num-layers", "2",
                           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                           "--max-new-tokens", "40",
                           "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--max-new-tokens" in proc.stderr and "exceeds --seq-length 32" in proc.stderr
    proc = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--num-layers", "2",
                           "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                           "--reward-fn", "puzzle.nope:missing"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "cannot import module 'puzzle.nope'" in proc.stderr


def test_malformed_prompt_file_names_file_and_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n{"text": "no key"}\n')
    base = [sys.executable, str(REPO / "train_ppo.py"), "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64",
            "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction",
            "--prompt-data", str(bad), "--rollout-batch-size", "1"]
    proc = subprocess.run(base, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"{bad}:2: prompt must be a string, got int" in proc.stderr, proc.stderr[-2000:]

