"""The error of a checkpoint that this run cannot resume (raised while checking, verifying or
loading one): a usage error, one line naming the file and the problem (puzzle.fail_fast)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed by this run; the message names the file and the problem."""
