"""GRPO-family flags: the role set follows the estimator and KL settings (every layer reads it
from cfg.roles), batch checks count samples, bad combinations name their flag before allocation."""

import json

import pytest

from puzzle.arguments import ArgumentError, config_for_planning, parse_args, validate_args
from puzzle.plan_search.command import job_from_config, memory_estimate, placement_from_config, search
from puzzle.plan_search.profile_data import load_profile

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--micro-batch-size", "2", "--rollout-batch-size", "8",
        "--max-new-tokens", "16", "--reward-fn", "puzzle.reward_functions.builtin:exact_match"]
GRPO = ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "4"]


def cfg(*extra, world=4, vocab=259):
    return validate_args(parse_args(BASE + list(extra)), world, vocab)


def test_role_sets_follow_the_estimator_and_kl():
    assert set(cfg().roles) == {"actor", "critic", "ref"}  # PPO as before
    assert set(cfg(*GRPO).roles) == {"actor", "ref"}  # kl in the reward (default --kl-coef 0.05)
    assert set(cfg(*GRPO, "--kl-coef", "0").roles) == {"actor"}
    assert set(cfg(*GRPO, "--kl-coef", "0", "--use-kl-loss").roles) == {"actor", "ref"}
    assert set(cfg("--kl-coef", "0").roles) == {"actor", "critic"}  # gae keeps its critic
    for est in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"):
        assert "critic" not in cfg("--advantage-estimator", est, "--n-samples-per-prompt", "2").roles
    c = cfg(*GRPO, "--kl-coef", "0")
    assert set(placement_from_config(c)) == {"actor"}


def test_samples_per_iteration_and_derived_values():
    c = cfg(*GRPO, "--global-batch-size", "8", "--clip-eps-high", "0.28", "--loss-agg-mode", "seq-mean-token-sum")
    assert c.ppo.num_samples == 32 and c.ppo.mini_batch_size == 8
    assert c.ppo.clip_eps == 0.2 and c.ppo.clip_eps_high == 0.28
    assert c.optim.lr_decay_iters == 10 * 4  # train iters x mini-batches per iteration
    assert cfg(*GRPO).ppo.mini_batch_size == 32  # default: the whole rollout
    assert cfg(*GRPO, "--no-grpo-std-normalization").ppo.grpo_std_normalization is False
    assert cfg("--reward-timeout", "0").reward_timeout is None


@pytest.mark.parametrize("extra, flag, text", [
    (["--advantage-estimator", "grpo"], "--n-samples-per-prompt", "at least 2 samples per prompt (got 1)"),
    (["--advantage-estimator", "rloo", "--n-samples-per-prompt", "1"], "--n-samples-per-prompt", "rloo"),
    (["--filter-groups", "--n-samples-per-prompt", "4"], "--filter-groups", "not gae"),
    (GRPO[:2] + ["--filter-groups", "--n-samples-per-prompt", "1"], "--n-samples-per-prompt", ""),
    (["--reward-fn", "", "--reward-model", "random", "--advantage-estimator", "remax"],
     "--advantage-estimator", "needs --reward-fn"),
    (["--reward-fn", "", "--reward-model", "random", *GRPO, "--filter-groups"], "--filter-groups", "--reward-fn"),
    (["--advantage-estimator", "remax", "--n-samples-per-prompt", "2", "--filter-groups"], "--filter-groups", "remax"),
    (GRPO + ["--global-batch-size", "3"], "--global-batch-size", "8 prompts x 4 samples = 32"),
    (GRPO + ["--micro-batch-size", "3"], "--global-batch-size", ""),
    (GRPO + ["--generation-micro-batch-size", "3"], "--generation-micro-batch-size", "samples per generation DP rank (8)"),
    (["--overlong-buffer-len", "17"], "--overlong-buffer-len", "[0, --max-new-tokens 16]"),
    (["--clip-eps-high", "0"], "--clip-eps-high", "> 0"),
    (["--reward-workers", "-1"], "--reward-workers", ""),
    (["--bad-reward-value", "nan"], "--bad-reward-value", "finite"),
    (GRPO + ["--kl-coef", "0", "--train-placement", "disjoint"], "--train-placement", "disjoint"),
])
def test_bad_combinations_name_the_flag(extra, flag, text):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    assert str(e.value).startswith(flag) and text in str(e.value), str(e.value)


def test_rollout_divisibility_counts_samples():
    cfg("--rollout-batch-size", "2", *GRPO, world=4)  # 8 samples over D=4 x micro-batch 2 (2 prompts would not do)
    with pytest.raises(ArgumentError, match="--global-batch-size: the rollout batch 8 prompts x 3 samples = 24"):
        cfg("--advantage-estimator", "grpo", "--n-samples-per-prompt", "3", "--global-batch-size", "16")


def test_planning_and_dry_run_see_the_role_set():
    args = parse_args(BASE + GRPO + ["--kl-coef", "0", "--use-kl-loss", "--world-size", "4",
                                     "--rollout-batch-size", "8"])
    c = config_for_planning(args)
    assert set(c.roles) == {"actor", "ref"}
    profile = load_profile("cpu_tiny_4ranks")
    reports = memory_estimate(c, profile)
    assert all("critic" not in " ".join(n for n, _ in r.items) for r in reports)
    job = job_from_config(c, profile)
    assert job.roles == ("actor", "ref")
    result, _ = search(c, profile)
    assert set(result.plans) == {"actor", "ref"}
    doc = json.loads(json.dumps(result.to_dict()))
    assert "critic" not in doc["plans"]


def test_cli_refuses_before_any_process_group(capsys):
    """train_ppo.py's driver: an unimportable reward function or grpo with N=1 stops with exit code
    2 and one message, before torch.distributed starts (it is never initialised here)."""
    import torch.distributed as dist

    from puzzle.cli import run

    base = BASE[:-2] + ["--advantage-estimator", "grpo", "--init-random"]
    assert run(base + ["--n-samples-per-prompt", "4", "--reward-fn", "my_rewards:score"]) == 2
    assert "error: --reward-fn 'my_rewards:score': cannot import module 'my_rewards'" in capsys.readouterr().err
    assert run(base + ["--reward-fn", "puzzle.reward_functions.builtin:exact_match"]) == 2
    assert "error: --n-samples-per-prompt: --advantage-estimator grpo" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_multi_turn_flags_are_checked_at_start():
    c = cfg(*GRPO, "--env", "calculator", "--max-turns", "3", world=1)
    assert (c.env, c.max_turns, c.max_observation_tokens) == ("calculator", 3, 64)
    assert cfg("--env", "single_turn", world=1).max_turns == 1
    for extra, flag, why in [(["--max-turns", "2"], "--max-turns", "needs --env"),
                             (["--env", "calculator", "--max-turns", "0"], "--max-turns", ">= 1"),
                             (["--env", "calculator", "--max-turns", "2", "--advantage-estimator", "remax",
                               "--n-samples-per-prompt", "2"], "--max-turns", "not yet scored for --advantage-estimator remax"),
                             (["--env", "calculator", "--reward-model", "random", "--reward-fn", ""], "--env",
                              "one reward source")]:
        with pytest.raises(ArgumentError, match=f"{flag}.*{why}"):
            cfg(*extra, world=1)
    assert cfg(*GRPO, "--env", "calculator", "--max-turns", "2", "--tensor-model-parallel-size", "2",
               world=2).max_turns == 2  # T > 1 generates multi-turn samples
    with pytest.raises(ArgumentError, match=r"--max-turns.*P=1 without an expert-parallel split for now; the actor "
                                            r"generates at \(P=2, D=1, T=1\)"):
        cfg(*GRPO, "--env", "calculator", "--max-turns", "2", "--pipeline-model-parallel-size", "2", world=2)
    with pytest.raises(ArgumentError, match="--env-step-overlap-calls.*>= 0"):
        cfg(*GRPO, "--env", "calculator", "--max-turns", "2", "--env-step-overlap-calls", "-1", world=1)
