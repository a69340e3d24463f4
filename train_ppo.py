"""PPO entry point, like Megatron-LM's pretrain_gpt.py: patches -> args -> PPOTrainer.

    torchrun --nproc-per-node 4 train_ppo.py --num-layers 2 --hidden-size 64 ... "$@"
"""

import sys


def main(argv=None) -> int:
    from puzzle.fail_fast import quiet_startup_warnings

    quiet_startup_warnings()  # megatron-core's TE/Apex notes dropped; warnings once, from rank 0
    import megatron_patches

    megatron_patches.apply()
    from puzzle.cli import run

    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":  # guard: the reward worker pool spawns processes that import this module
    from puzzle.parallel import launcher

    launcher.exit_process(main())
