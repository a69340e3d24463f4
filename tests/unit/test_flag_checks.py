"""Every bad flag stops train_ppo.py before any process group or model exists: one line naming the
flag, printed once (rank 0), non-zero exit. Called in-process through the CLI entry (RANK unset)."""

import os

import pytest

from puzzle import cli
from puzzle.arguments import ArgumentError, parse_args, validate_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--micro-batch-size", "2", "--rollout-batch-size", "8",
        "--max-new-tokens", "16", "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction",
        "--init-random"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _not_a_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    return str(f / "sub")  # under a regular file: cannot be created, even by root


BAD = [
    (["--lr", "-1"], "--lr: must be >= 0"),
    (["--critic-lr", "-1"], "--critic-lr: must be >= 0"),
    (["--min-lr", "-0.1"], "--min-lr: must be >= 0"),
    (["--lr", "1e-5", "--min-lr", "1e-4"], "--min-lr: 0.0001 exceeds --lr 1e-05"),
    (["--critic-lr", "1e-6", "--min-lr", "1e-5", "--lr", "1e-4"], "--min-lr: 1e-05 exceeds --critic-lr"),
    (["--weight-decay", "-1"], "--weight-decay: must be >= 0"),
    (["--adam-beta1", "2"], "--adam-beta1: must lie in [0, 1)"),
    (["--adam-beta2", "1.0"], "--adam-beta2: must lie in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps: must be > 0"),
    (["--clip-grad", "-1"], "--clip-grad: must be >= 0"),
    (["--lr-warmup-iters", "-5"], "--lr-warmup-iters: must be >= 0"),
    (["--kl-horizon", "0"], "--kl-horizon: must be >= 1"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by: must be >= 1"),
    (["--clip-eps", "-0.2"], "--clip-eps: must be > 0"),
    (["--value-clip-eps", "0"], "--value-clip-eps: must be > 0"),
    (["--reward-clip", "-1"], "--reward-clip: must be > 0"),
    (["--seq-length", "128"], "--seq-length: 128 exceeds --max-position-embeddings 64"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout: must lie in [0, 1)"),
    (["--norm-epsilon", "0"], "--norm-epsilon: must be > 0"),
    (["--global-batch-size", "0"], "--global-batch-size: must be >= 1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes: must be > 0"),
    (["--exit-interval", "0"], "--exit-interval: must be >= 1"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins: must be > 0"),
    (["--skip-nonfinite-iterations", "-1"], "--skip-nonfinite-iterations: must be >= 0"),
    (["--keep-last-checkpoints", "2"], "--keep-last-checkpoints: needs --save DIR"),
    (["--wandb-exp-name", "x"], "--wandb-exp-name: needs --wandb-project"),
    (["--fp16"], "--fp16: fp16 training needs a GPU"),
    (["--train-iters", "0"], "--train-iters: must be >= 1"),
    (["--profile", "a100_80gb"], "--profile: used by --plan auto and --dry-run only"),
    (["--ckpt-step", "3"], "--ckpt-step: needs --load DIR"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--critic-tensor-model-parallel-size", "0"], "--critic-tensor-model-parallel-size: must be >= 1"),
    (["--actor-gen-pipeline-model-parallel-size", "0"], "--actor-gen-pipeline-model-parallel-size: must be >= 1"),
    (["--critic-rank-offset", "-1"], "--critic-rank-offset: must be >= 0"),
    (["--critic-hidden-size", "65"], "--critic-hidden-size: hidden_size=65 is not divisible"),
    # accepted flags that would change nothing are refused
    (["--num-query-groups", "2"], "--num-query-groups: needs --group-query-attention"),
    (["--advantage-estimator", "grpo", "--n-samples-per-prompt", "2", "--critic-lr", "1e-4"],
     "--critic-lr: the run builds no critic model (--advantage-estimator grpo has no critic)"),
    (["--advantage-estimator", "rloo", "--n-samples-per-prompt", "2", "--critic-rank-offset", "1"],
     "--critic-rank-offset: the run builds no critic model"),
    (["--kl-coef", "0", "--ref-num-layers", "3"], "--ref-num-layers: the run builds no ref model"),
    (["--reward-tensor-model-parallel-size", "2"], "--reward-tensor-model-parallel-size: the run builds no reward"),
    (["--position-embedding-type", "learned_absolute", "--rotary-base", "500"],
     "--rotary-base: needs --position-embedding-type rope"),
    (["--tokenizer-model", "tok"], "--tokenizer-model: --tokenizer-type ByteLevelTokenizer reads no files"),
    (["--vocab-size", "100"], "--vocab-size: 100 is smaller than the tokenizer's vocabulary (259)"),
    (["--kl-horizon", "500"], "--kl-horizon: needs --kl-target"),
    (["--kl-target", "6", "--kl-coef", "0", "--use-kl-loss"], "--kl-target: needs --kl-coef > 0"),
    (["--kl-loss-coef", "0.1"], "--kl-loss-coef: needs --use-kl-loss"),
    (["--kl-loss-type", "mse"], "--kl-loss-type: needs --use-kl-loss"),
    (["--max-num-gen-batches", "3"], "--max-num-gen-batches: needs --filter-groups"),
    (["--overlong-penalty-factor", "2"], "--overlong-penalty-factor: needs --overlong-buffer-len > 0"),
    (["--advantage-estimator", "grpo", "--n-samples-per-prompt", "2", "--lam", "0.9"], "--lam: GAE's lambda: needs"),
    (["--min-lr", "1e-7"], "--min-lr: needs --lr-decay-style linear or cosine"),
    (["--greedy", "--top-p", "0.9"], "--top-p: is ignored by --greedy"),
    (["--kl-coef", "0", "--kl-estimator", "mse"], "--kl-estimator: needs a reference model"),
    (["--reward-timeout", "5", "--reward-fn", "", "--reward-model", "random"], "--reward-timeout: needs --reward-fn"),
    (["--reward-workers", "2", "--reward-fn", "", "--reward-model", "random"], "--reward-workers: needs --reward-fn"),
    (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3 (see train_ppo.py --help)"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_flag_fails_once_before_anything_starts(extra, message, capsys):
    import torch.distributed as dist

    assert cli.run(BASE + extra) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {message}" + err[len("error: ") + len(message):]  # starts with it
    assert err.count("\n") == 1 and "usage:" not in err and out == ""  # one line, no usage text
    assert not dist.is_initialized()


@pytest.mark.parametrize("flag", ["--save", "--log-dir", "--tensorboard-dir"])
def test_unwritable_output_directory(flag, tmp_path, capsys):
    path = _not_a_dir(tmp_path)
    assert cli.run(BASE + [flag, path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: {path!r} is not a writable directory"), err


def test_other_ranks_print_nothing(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    assert cli.run(BASE + ["--lr", "-1"]) == 2
    assert cli.run(BASE + ["--bogus"]) == 2
    assert cli.run(BASE + ["--help"]) == 0
    assert capsys.readouterr() == ("", "")


def test_missing_optional_logging_package_is_named(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ArgumentError, match=r"--wandb-project: the wandb package is not installed"):
        validate_args(parse_args(BASE + ["--wandb-project", "p"]), 1, 259)


def test_accepted_values_are_kept(tmp_path):
    cfg = validate_args(parse_args(BASE + [
        "--clip-grad", "0", "--exit-signal-handler", "--exit-duration-in-mins", "0.5",
        "--exit-interval", "3", "--distributed-timeout-minutes", "0.1", "--skip-nonfinite-iterations", "2",
        "--save", str(tmp_path / "ck"), "--keep-last-checkpoints", "2"]), 1, 259)
    assert cfg.optim.clip_grad == 0.0  # 0 switches clipping off, as in Megatron-LM
    ops = cfg.ops
    assert (ops.exit_signal_handler, ops.exit_duration_in_mins, ops.exit_interval) == (True, 0.5, 3)
    assert (ops.distributed_timeout_minutes, ops.skip_nonfinite_iterations, ops.keep_last_checkpoints) == (0.1, 2, 2)
    assert os.path.isdir(tmp_path / "ck") and not os.listdir(tmp_path / "ck")  # created, probe removed


def test_vocab_size_sets_the_model_vocabulary():
    """--vocab-size: the model's rows before padding (at least the tokenizer's), as in Megatron-LM."""
    cfg = validate_args(parse_args(BASE + ["--vocab-size", "300"]), 1, 259)
    assert {r.arch.vocab_size for r in cfg.roles.values()} == {300}
    assert validate_args(parse_args(BASE), 1, 259).roles["actor"].arch.vocab_size == 259


def test_test_faults_are_read_once_by_the_command_line(monkeypatch, capsys):
    """The fault-injection variables of the tests become RunConfig.faults; a malformed one is an
    error before anything starts; an ordinary run has no faults."""
    from puzzle.config import FaultInjection

    got = cli.fault_injection_from_env({cli.NONFINITE_ENV: "critic:2,actor:10", cli.FAIL_SAVE_ENV: "1:5"})
    assert got == FaultInjection(nonfinite_grads=(("critic", 2), ("actor", 10)), fail_save_at=(1, 5))
    assert cli.fault_injection_from_env({}) == FaultInjection()
    for env, message in (({cli.NONFINITE_ENV: "critic"}, "expected role:iteration"),
                         ({cli.FAIL_SAVE_ENV: "one:5"}, "expected rank:iteration"),
                         ({cli.FAIL_SAVE_ENV: "0:1,1:2"}, "one rank:iteration")):
        with pytest.raises(ValueError, match=message):
            cli.fault_injection_from_env(env)
    monkeypatch.setenv(cli.FAIL_SAVE_ENV, "x")
    assert cli.run(BASE) == 2
    assert capsys.readouterr().err.startswith(f"error: ${cli.FAIL_SAVE_ENV}: expected rank:iteration")
