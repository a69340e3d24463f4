"""4-rank world: every critic-free estimator (with KL loss, KL in the reward, clip-higher, each
loss aggregation, overlong shaping, dynamic sampling, running reward normalisation) runs one
iteration at two layouts -- all roles (1,4,1) sequential, and actor/ref (2,1,2) time-shared with
the actor generating at (1,2,2) through the switch -- and reports its metrics; plus the bad-reward
policy with a reward function that fails on one rank only; plus --rl-desired-lag 1 on a training
pool (ranks 0-1) and a generation pool (ranks 2-3) with evaluation, lag 0 on the same pools, and
the lag-1 run preempted, saved with its batch in flight and resumed (check_overlap).
"""

import json

import torch

from puzzle.arguments import parse_args, validate_args
from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
from puzzle.data.tokenizers import build_tokenizer
from puzzle.reward_functions import BadRewardError, Sample
from puzzle.reward_functions.distributed import RolloutRewarder
from puzzle.dataflow.trainer import PPOTrainer
from tests.harness import world_main

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "40", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--max-new-tokens", "6",
         "--micro-batch-size", "2", "--ppo-epochs", "2", "--lr", "5e-3", "--train-iters", "1",
         "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--temperature", "1.0"]
LAYOUTS = {
    "seq": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"],
    "ts": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--actor-gen-tensor-model-parallel-size", "2", "--actor-gen-pipeline-model-parallel-size", "1",
           "--score-placement", "time-sharing", "--train-placement", "time-sharing"],
}
CONFIGS = {
    "grpo": ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "4", "--rollout-batch-size", "4",
             "--global-batch-size", "8", "--kl-coef", "0", "--use-kl-loss", "--kl-loss-coef", "0.1",
             "--clip-eps-high", "0.28"],
    "rloo": ["--advantage-estimator", "rloo", "--n-samples-per-prompt", "4", "--rollout-batch-size", "4",
             "--global-batch-size", "8", "--kl-coef", "0.05", "--loss-agg-mode", "seq-mean-token-mean"],
    "reinforce_plus_plus": ["--advantage-estimator", "reinforce_plus_plus", "--n-samples-per-prompt", "2",
                            "--rollout-batch-size", "4", "--kl-coef", "0", "--loss-agg-mode", "seq-mean-token-sum",
                            "--overlong-buffer-len", "3", "--gamma", "0.9"],
    "reinforce_plus_plus_baseline": ["--advantage-estimator", "reinforce_plus_plus_baseline",
                                     "--n-samples-per-prompt", "4", "--rollout-batch-size", "2", "--kl-coef", "0",
                                     "--filter-groups", "--reward-normalization", "running",
                                     "--reward-fn", "tests.unit.reward_fixtures:half_constant"],
    "remax": ["--advantage-estimator", "remax", "--rollout-batch-size", "8", "--global-batch-size", "8",
              "--kl-coef", "0", "--no-grpo-std-normalization"],
}


def _run(name, layout):
    tok = build_tokenizer("ByteLevelTokenizer", None)
    cfg = validate_args(parse_args(MODEL + CONFIGS[name] + LAYOUTS[layout]), torch.distributed.get_world_size(),
                        tok.vocab_size)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, max_prompt_len=cfg.ppo.max_prompt_length)
    trainer = PPOTrainer(cfg, tok, ds)
    n = cfg.ppo.rollout_batch_size
    batches = iter([ds.prompts[i * n:(i + 1) * n] for i in range(8)])

    def refill():
        return next(batches), None

    try:
        m = trainer.step(next(batches), refill=refill)
    finally:
        trainer.close()
    return {"roles": sorted(trainer.engines), "switch": trainer.switch is not None,
            **{k: v for k, v in m.items() if not k.startswith("time_") and k != "samples_per_sec"
               and not k.startswith("switch_")}}


def check_estimators():
    return {f"{name}/{layout}": _run(name, layout) for name in CONFIGS for layout in LAYOUTS}


def check_bad_reward_one_rank():
    """Rank 3's share raises: every rank sees the same scores (default) or the same error."""
    B = 8
    recs = [{"value": 0.5 if b < 6 else "raise"} for b in range(B)]

    def make(b):
        return Sample(index=b, prompt_text="p", response_text="r", prompt_ids=[1], response_ids=[2], record=recs[b])

    out = {}
    r = RolloutRewarder("tests.unit.reward_fixtures:batched_by_record", bad_reward_value=-2.0)
    scores, bad = r.score(make, B, iteration=5)
    out["scores"], out["bad"] = scores.tolist(), bad
    strict = RolloutRewarder("tests.unit.reward_fixtures:batched_by_record", on_bad_reward="error")
    try:
        strict.score(make, B, iteration=5)
        out["error"] = None
    except BadRewardError as e:
        out["error"] = str(e)
    torch.distributed.barrier()  # every rank is still here
    out["after"] = True
    return out


OVERLAP = ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "4", "--rollout-batch-size", "4",
           "--kl-coef", "0", "--rl-inference-logprobs-is-correction", "--actor-gen-rank-offset", "2",
           "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--actor-gen-tensor-model-parallel-size", "2", "--log-interval", "1000", "--ppo-epochs", "1",
           "--reward-timeout", "0", "--micro-batch-size", "8"]
# (rewards in the rank's own process: no worker pool to start per run; one micro-batch of 8 rows per
# DP rank, so that the training pool's (1,2,1) and (2,1,1) sum the same gradients in the same order)


#: evaluation in the overlap's runs: 4 greedy prompts at iterations 0, 2 and the end
OVERLAP_EVAL = ["--eval-prompts", str(bundled_prompts_path()), "--eval-iters", "1", "--eval-interval", "2"]
# the training pool's other layout: (2,1,1), the generation pool's unchanged
TRAIN_P2 = ["--pipeline-model-parallel-size", "2", "--actor-gen-pipeline-model-parallel-size", "1"]


def _overlap_run(lag: int, *extra: str, signal_at=None) -> dict:
    """One run (PPOTrainer.for_run + train(), the CLI's path) on 2 training + 2 generation ranks at
    ``lag``: each logged row (rank 0's), and per batch what the generation pool sampled (rows and
    log-probs), and what the training pool trained (rows, the behaviour log-probs the loss read,
    the current policy's, the token versions). ``signal_at``: rank 3 (generation pool) gets a
    SIGTERM while it generates that batch (a preemption under --exit-signal-handler)."""
    import os
    import signal

    tok = build_tokenizer("ByteLevelTokenizer", None)
    argv = MODEL + OVERLAP + OVERLAP_EVAL + ["--rl-desired-lag", str(lag), "--train-iters", "4", *extra]
    cfg = validate_args(parse_args(argv), torch.distributed.get_world_size(), tok.vocab_size)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, max_prompt_len=cfg.ppo.max_prompt_length)
    trainer = PPOTrainer.for_run(cfg, tok, ds, ds, progress=lambda iteration, phase: None)
    sampled, trained, rows = {}, {}, []
    generate, train = trainer.generation.run, trainer.training.run

    def generation_run(prompt_ids, records, refill, it):
        if it == signal_at and torch.distributed.get_rank() == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        out = generate(prompt_ids, records, refill, it)
        if trainer.engines["actor"].member is False:  # the generation pool's own record
            sampled[it] = (out.batch.tokens.tolist(), out.batch.gen_logprobs.tolist())
        return out

    def training_run(batch, it):
        versions = trainer.last_rollout.versions if trainer.last_rollout is not None else None
        trained[it] = {"tokens": batch.tokens.tolist(), "loss_behaviour": batch.gen_logprobs.tolist(),
                       "old": batch.old_logprobs.tolist(), "mask": batch.response_mask.tolist(),
                       "versions": None if versions is None else versions.tolist()}
        return train(batch, it)

    trainer.generation.run, trainer.training.run = generation_run, training_run
    log = trainer.logger.log
    trainer.logger.log = lambda m: (rows.append({k: v for k, v in m.items() if not k.startswith("time_")
                                                 and k not in ("samples_per_sec", "tokens_per_sec")}), log(m))
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"rows": rows, "sampled": sampled, "trained": trained}


def check_overlap():
    """--rl-desired-lag 1 on 2 + 2 ranks for 4 iterations with evaluation; lag 0 on the same pools
    (the synchronous path) stopped after 2; the lag-1 run preempted (SIGTERM) while it generates
    batch 3, so saved at iteration 2 with batch 3 in flight, then resumed at lag 1 with the training
    pool at (2,1,1), and at lag 0 for one iteration; timed."""
    import os
    import shutil
    import tempfile
    import time

    from puzzle.parallel.device import runtime

    t0 = time.perf_counter()
    out = {"lag1": _overlap_run(1), "lag0": _overlap_run(0, "--exit-interval", "2")}
    rank = torch.distributed.get_rank()
    d = runtime().broadcast_object(tempfile.mkdtemp(prefix="puzzle-overlap-") if rank == 0 else None)
    ck = os.path.join(d, "ck")
    try:
        out["preempted"] = _overlap_run(1, "--save", ck, "--exit-signal-handler", signal_at=3)
        with open(os.path.join(ck, "iter_0000002", "trainer_state.json")) as f:
            held = json.load(f).get("overlap", {})
        out["in_flight"] = {"lag": held.get("lag"), "batches": [(b["index"], b["version"], b["tokens"])
                                                                for b in held.get("batches", [])]}
        out["resumed"] = _overlap_run(1, "--load", ck)
        out["resumed_p2"] = _overlap_run(1, "--load", ck, *TRAIN_P2)
        out["resumed_lag0"] = _overlap_run(0, "--load", ck, "--exit-interval", "3")
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    world_main([("bad_reward", check_bad_reward_one_rank), ("estimators", check_estimators),
                ("overlap", check_overlap)])
