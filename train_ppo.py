"""PPO entry point, like Megatron-LM's pretrain_gpt.py: patches -> args -> PPOTrainer.

    torchrun --nproc-per-node 4 train_ppo.py --num-layers 2 --hidden-size 64 ... "$@"
"""

import sys


def main(argv=None) -> int:
    import logging
    import warnings

    from puzzle.parallel import launcher

    # megatron-core warns at import that the optional TE/Apex kernels are absent (README explains)
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex).*")
    if launcher.rank() != 0:  # warnings (megatron-core's, torch's): once, from rank 0
        warnings.simplefilter("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
    import megatron_patches

    megatron_patches.apply()
    from puzzle.cli import run

    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":  # guard: dist-checkpoint async saving spawns processes
    sys.exit(main())
