"""The tiny PPO run (examples/run_ppo_tiny.sh's flags, 2 greedy iterations) built in-process at
every layout the end-to-end tests compare, each a PPOTrainer in this world, run and closed before
the next. On 4 ranks: the script's own layouts (the reference), the actor generating through the
switch, time-shared scoring and training, disjoint placement, --plan auto, and a reward model at
two layouts. On 1 rank (``one_rank`` given as the argument): every model at (1,1,1)."""

import sys

from tests.harness import tiny_flags, train_in_world, world_main

SMALL = ["--train-iters", "2", "--greedy", "--rollout-batch-size", "8", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--max-new-tokens", "8"]
ALL_AT_ONE = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--critic-tensor-model-parallel-size", "1", "--critic-pipeline-model-parallel-size", "1"]
RUNS = {
    # actor and reference at (2,1,2), critic at (1,2,2), sequential: run_ppo_tiny.sh's layouts
    "reference": [],
    # every model at (1,1,1): a world of one rank
    "one_rank": ALL_AT_ONE,
    "switch": ["--actor-gen-tensor-model-parallel-size", "2", "--actor-gen-pipeline-model-parallel-size", "1",
               "--switch-segments", "4", "--ranks-per-node", "2"],
    "time_sharing": ["--critic-pipeline-model-parallel-size", "2",  # all at (2,1,2)
                     "--score-placement", "time-sharing", "--train-placement", "time-sharing"],
    "disjoint": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                 "--actor-data-parallel-size", "2", "--ref-data-parallel-size", "2",
                 "--critic-rank-offset", "2", "--critic-data-parallel-size", "2",
                 "--critic-tensor-model-parallel-size", "1",
                 "--score-placement", "disjoint", "--train-placement", "disjoint"],
    "plan_auto": ["--plan", "auto"],
    # four models: a (random) reward model at (1,4,1), and following the actor at (2,1,2)
    "reward_141": ["--reward-fn", "", "--reward-model", "random", "--reward-tensor-model-parallel-size", "1",
                   "--reward-pipeline-model-parallel-size", "1"],
    "reward_212": ["--reward-fn", "", "--reward-model", "random"],
}


def check_runs():
    only = sys.argv[1:] or [name for name in RUNS if name != "one_rank"]  # the runs named, else all 4-rank ones
    return {name: train_in_world(tiny_flags() + SMALL + RUNS[name], print_plan=name == "plan_auto")
            for name in only}


if __name__ == "__main__":
    world_main([("runs", check_runs)])
