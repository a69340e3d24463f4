"""The launcher's contract: the only module below the command line that reads the environment.

torchrun (alone, or under Slurm's ``srun torchrun``) starts one process per rank and tells each,
through the environment, who it is: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (the device index
on its node), ``MASTER_ADDR`` / ``MASTER_PORT`` (the rendezvous that torch.distributed's env://
initialisation reads). A plain ``python train_ppo.py`` has none of them: it is rank 0 of a world
of one. Everything else a run needs comes from flags, through the frozen RunConfig; nothing below
the command-line layer reads ``os.environ`` but this module (tests/unit/test_layering.py checks it).
"""

from __future__ import annotations

import os


def launched() -> bool:
    """Whether a launcher (torchrun) set this process's rank."""
    return "RANK" in os.environ


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of ranks the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node: the index of its CUDA device (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """The number of ranks the launcher started on this node (1 without a launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def default_to_world_of_one(port: int) -> None:
    """Without a launcher: the environment of rank 0 of a world of one (rendezvous on ``port`` of
    this host), so torch.distributed's env:// initialisation works the same way."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
