"""End-to-end tiny PPO runs (CPU, gloo): the README quick start, layout invariance, bad flags.

The quick start runs examples/run_ppo_tiny.sh as a user would (its first iterations on 4 ranks;
its learning curve on one rank). The layout comparisons run the
same script's flags in one 4-rank world (tests/distributed/worlds/tiny_runs.py), a trainer per
layout; the bad flags go through train_ppo.py's command-line driver in this process."""

import math

import pytest

from puzzle import cli
from tests.harness import TINY_CLI, TINY_PPO, assert_same_metrics, read_metrics, run_script, run_world


#: the quick start's flags on one rank: every model at (P,D,T) = (1,1,1), the same arithmetic up
#: to the order of fp32 sums (a third of the CPU time of 4 ranks on 2 cores)
ONE_RANK = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--critic-tensor-model-parallel-size", "1"]
QUICK_START_ITERS = 4


@pytest.mark.learning
@pytest.mark.launch_ahead(TINY_PPO, ONE_RANK, 1)
def test_tiny_run_learns(ahead, tmp_path):
    """The README quick start as a user runs it (4 ranks, the actor at (2,1,2)) for its first
    QUICK_START_ITERS iterations, with a save at the end: also the suite's 4-rank training job
    (the reward worker pool, a save) that must exit 0 without an abort at exit (run_script
    checks; tests/e2e/test_clean_exit.py). Its 24 iterations on one rank, launched ahead
    (tests/conftest.py), learn: reward of the last 5 iterations clearly above the first 5; their
    first iterations are the 4-rank run's (the same sampled tokens, fp32 sums in another order)."""
    proc, rows = run_script(TINY_PPO, ["--train-iters", str(QUICK_START_ITERS), "--save", str(tmp_path / "ckpt")],
                            tmp_path / "four", timeout=900)
    one = ahead.finish(timeout=900)
    assert one.returncode == 0 and "terminate called" not in one.stderr, (one.stdout + one.stderr)[-6000:]
    assert len(rows) == QUICK_START_ITERS and (tmp_path / "ckpt" / f"iter_{QUICK_START_ITERS:07d}").is_dir()
    for key in ("iteration", "reward_mean", "kl", "policy_loss", "value_loss", "clip_frac", "entropy",
                "response_length_mean", "samples_per_sec", "time_generate", "time_score", "time_train"):
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    assert rows[0]["prompts_loaded"] == 64 and rows[0]["prompts_dropped"] == 0  # the bundled set
    last = next(line for line in proc.stdout.splitlines()
                if line.startswith(f" iteration {QUICK_START_ITERS:>8}/{QUICK_START_ITERS:>8} | elapsed: "))
    assert "| ETA: 0:00:00 | learning rate: 2.000E-03 | reward: " in last and "grad norm actor/critic: " in last
    whole = read_metrics(ahead.log_dir)
    assert len(whole) == 24
    assert_same_metrics(whole[:QUICK_START_ITERS], rows, KEYS, rel=1e-4, abs=1e-5)
    first = sum(r["reward_mean"] for r in whole[:5]) / 5
    last = sum(r["reward_mean"] for r in whole[-5:]) / 5
    assert last > first + 0.05, (first, last)
    assert max(r["kl"] for r in whole) < 2.0


KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "clip_frac", "entropy", "value_mean",
        "return_mean", "response_length_mean", "actor_grad_norm", "critic_grad_norm")


@pytest.fixture(scope="module")
def runs():
    """Greedy 2-iteration runs (worlds/tiny_runs.py); "reference": actor and reference at
    (2,1,2), critic at (1,2,2), sequential (the script's layouts); "one_rank": a world of one."""
    runs = run_world("distributed/worlds/tiny_runs.py", 4, timeout=900)[0]["runs"]
    return dict(runs, **run_world("distributed/worlds/tiny_runs.py", 1)[0]["runs"])


def _same(run, reference, rel=1e-5, abs=1e-6):
    assert len(run["rows"]) == len(reference["rows"]) == 2
    assert_same_metrics(run["rows"], reference["rows"], KEYS, rel=rel, abs=abs)


def test_layout_changes_no_numbers(runs):
    """The same greedy metrics at (1,1,1) on 1 rank as with the actor at (2,1,2) on 4 ranks."""
    _same(runs["one_rank"], runs["reference"], rel=1e-4, abs=1e-5)


def test_switch_changes_no_numbers(runs):
    """The actor generating at (1,2,2) through the switch (overlapped with its optimizer step)."""
    assert runs["switch"]["switch"] and not runs["reference"]["switch"]
    _same(runs["switch"], runs["reference"])


def test_time_sharing_changes_no_numbers(runs):
    """Scoring (actor, ref, critic) and training (actor, critic) time-shared at P=2."""
    _same(runs["time_sharing"], runs["reference"])


def test_disjoint_placement_changes_no_numbers(runs):
    """actor+ref on ranks 0-1, critic on ranks 2-3: the groups run concurrently (SMDD)."""
    _same(runs["disjoint"], runs["reference"])


def test_plan_auto_runs_and_changes_no_numbers(runs):
    """--plan auto searches the layouts at start (bundled profile); the chosen plan runs."""
    assert runs["plan_auto"]["stdout"].startswith("plan: --actor-tensor-model-parallel-size")
    _same(runs["plan_auto"], runs["reference"])


def test_reward_model_at_two_layouts(runs):
    """Four models: a (random) reward model scores at (1,4,1) and at (2,1,2) with the same result."""
    a, b = runs["reward_141"], runs["reward_212"]
    assert a["roles"] == b["roles"] == ["actor", "critic", "ref", "reward"]
    _same(a, b)
    assert a["rows"][0]["reward_mean"] != 0.0


# ---- bad input: train_ppo.py's driver in this process, before any process group or model -----
@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _cli(capsys, argv):
    rc = cli.run(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_bad_flags_fail_before_allocation(single_process, capsys):
    rc, _, err = _cli(capsys, TINY_CLI + ["--seq-length", "32", "--max-new-tokens", "40"])
    assert rc == 2
    assert "--max-new-tokens" in err and "exceeds --seq-length 32" in err
    rc, _, err = _cli(capsys, TINY_CLI + ["--seq-length", "32", "--reward-fn", "puzzle.nope:missing"])
    assert rc == 2 and "cannot import module 'puzzle.nope'" in err


def test_malformed_prompt_file_names_file_and_line(tmp_path, single_process, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n{"text": "no key"}\n')
    rc, _, err = _cli(capsys, TINY_CLI + ["--prompt-data", str(bad), "--rollout-batch-size", "1"])
    assert rc == 2 and f"{bad}:2: prompt must be a string, got int" in err, err[-2000:]
