"""Save and resume a whole PPO run with megatron-core dist_checkpointing (torch_dist).

On disk (``--save DIR``)::

    DIR/latest_checkpointed_iteration.txt   "3" - written last, by rank 0, after the rename
    DIR/iter_0000003/
        metadata.json                       format, puzzle version, world size, per role: arch,
                                            layout(s), trainable, source of frozen weights
        trainer_state.json                  iteration, KL controller, LR schedulers, prompt loader,
                                            partial rollouts' carried samples, the overlap's batches
                                            in flight (--rl-desired-lag: in_flight_problem)
        actor/  critic/                     dist_checkpointing (torch_dist) of each trainable role:
                                            {"model": GPTModel.sharded_state_dict,
                                             "optimizer": optimizer.sharded_state_dict}
        rng/rank_00000.pt ...               per-rank RNG: torch CPU generator, megatron's RNG tracker
                                            (and the CUDA generator, Python, NumPy)

Integrity: once every rank has written its files, the ranks share the sha256 of every file of the
checkpoint (each hashes a slice of the file list it has just written) and rank 0 records them
with their sizes in metadata.json (``files``). A resume checks that every file is there with its
size before anything is built (``check_checkpoint``), then the checksums, the ranks again sharing
the work (``verify_checkpoint``); a missing, truncated or damaged file is one error naming the
file, the iteration and the newest intact checkpoint. Without a tracker file, the newest complete
and verified ``iter_*`` is resumed (and the log says so). ``--keep-last-checkpoints N`` deletes
older checkpoints after each save.

A save writes ``iter_N.tmp`` on every rank, barriers, then rank 0 renames it to ``iter_N`` and
only then rewrites the tracker file (write + ``os.replace``), so a checkpoint becomes visible
only once every rank has finished writing it; a save killed half way leaves the previous
checkpoint as the latest one (and a stale ``.tmp`` that the next save of that iteration replaces).
The files are written by threads of each rank's process (megatron_patches.checkpoint_writes_in_process:
nothing forks); a save runs in named phases, and a failure in one is a SaveError naming the rank,
the iteration and the phase (puzzle.save_failures).

Frozen models (ref, reward) are saved **by reference**: their weights are a pure function of
(arch, seed) or of their HF checkpoint (``RoleSpec.hf_path``), so metadata.json records that
source plus a weight fingerprint (float64 sum and sum of squares over the unique parameter
shards). On resume they are rebuilt from the same source and the fingerprint is checked; a
changed HF directory or seed is an error instead of a silently different reference model.

A LoRA actor (--lora-dim) saves its adapters alone (with their optimizer state) in ``actor/``,
each under its global name, split over T as its layout splits it, so they load at any other
(P, D, T) (puzzle.models.lora.adapter_sharded_state_dict); its frozen base is saved by reference:
metadata.json records the base's source (seed, HF or Megatron-LM checkpoint) and its weight
fingerprint, and a resume (or --finetune) whose base has another fingerprint is refused, naming
both. The fingerprint, not the source path, decides: the same weights moved to another path load.

Parallel groups: every model has its own ``ProcessGroupCollection``; megatron's global
``parallel_state`` is never initialised. ``GPTModel.sharded_state_dict`` takes its TP/PP ranks
from the model's own ``pg_collection`` (layers, embeddings, output layer) and its DP group from
``metadata['dp_cp_group']``, which we always pass (megatron would otherwise fall back to the
global DP group). The optimizers map their state onto the model's sharded tensors (plain
optimizer) or use the ``fully_sharded_model_space`` format (DistributedOptimizer), which is
layout-free; so weights *and* optimizer state reshard across (P, D, T) on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from puzzle.config import ROLES
from puzzle.models.init import is_expert_param
from puzzle.models.param_names import HEAD_LOCAL_NAME, drop_extra_state
from puzzle.parallel.device import runtime
from puzzle.checkpoint_errors import CheckpointError
from puzzle.checkpoint_metadata import (FORMAT, base_fingerprint_problem, fingerprints_match, role_source, run_metadata,
                                       run_problems)
from puzzle.rng_state import capture_rng_state, read_rng_file, set_rng_state
from puzzle.save_failures import SavePhases, first_line as _first_line, summarize as _summarize

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
TRAINER_STATE = "trainer_state.json"


@dataclass
class Checkpointed:
    """What a checkpoint holds, handed over by its owner (the trainer): the run's configuration
    (metadata, optimizer kind, --finetune, injected faults), the role engines (weights, optimizer
    states), ``state`` (a Stateful with an ``iteration``: the run's counters and the stages' small
    state, trainer_state.json) and the prompt ``loader`` (a Stateful, or None). ``progress``
    (iteration, phase) hears each phase of a save."""

    cfg: object
    engines: Dict[str, object]
    state: object
    loader: Optional[object] = None
    progress: Optional[Callable[[int, str], None]] = None


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iterations(root: str) -> List[int]:
    """Iterations of the published ``iter_*`` directories under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    its = [int(m.group(1)) for name in os.listdir(root)
           if (m := re.fullmatch(r"iter_(\d+)", name)) and os.path.isdir(os.path.join(root, name))]
    return sorted(its, reverse=True)


def read_tracker(root: str) -> Optional[int]:
    """The latest complete iteration under ``root`` (None: no checkpoint there)."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


# ---- metadata (layout-free description of the run) -------------------------------------------
def _read_metadata(d: str) -> dict:
    path = os.path.join(d, METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')} is not {FORMAT}")
    return meta


def _file_problems(d: str, meta: dict, files: Optional[List[str]] = None, hashes: bool = False) -> List[str]:
    """'FILE: what is wrong' for each file of the manifest (or of ``files``) that is not intact."""
    manifest = meta.get("files")
    if manifest is None:  # written before checksums existed: check what every resume needs
        needed = [TRAINER_STATE] + [os.path.join(r, f) for r, spec in meta.get("roles", {}).items()
                                    if spec.get("trainable") for f in (".metadata", "common.pt")]
        return [f"{os.path.join(d, f)}: missing" for f in needed if not os.path.isfile(os.path.join(d, f))]
    problems = []
    for rel in (sorted(manifest) if files is None else files):
        size, digest = manifest[rel]
        path = os.path.join(d, rel)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, saved with {size} (truncated or overwritten)")
        elif hashes and _sha256(path) != digest:
            problems.append(f"{path}: checksum mismatch (the file is damaged)")
    return problems


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _complete(root: str, it: int) -> bool:
    """Metadata readable and every file present with its saved size (no checksums)."""
    try:
        return not _file_problems(iter_dir(root, it), _read_metadata(iter_dir(root, it)))
    except CheckpointError:
        return False


def _newest_other(root: str, bad: int, intact) -> str:
    for it in saved_iterations(root):
        if it != bad and intact(it):
            return f"the newest intact checkpoint is iteration {it}: resume it with --ckpt-step {it}"
    return f"no other intact checkpoint under {root}"


def resume_iteration(root: str, iteration: Optional[int] = None) -> Tuple[Optional[int], str]:
    """(iteration to resume, how it was chosen): ``iteration`` (--ckpt-step), else the tracker's,
    else - no tracker but ``iter_*`` directories - the newest complete one ('scan');
    (None, 'none') when ``root`` holds no checkpoint."""
    if iteration is not None:
        return iteration, "ckpt-step"
    it = read_tracker(root)
    if it is not None:
        return it, "tracker"
    for it in saved_iterations(root):
        if _complete(root, it):
            return it, "scan"
    if saved_iterations(root):
        raise CheckpointError(f"{root}: no {TRACKER} and no complete iter_* checkpoint "
                              f"({', '.join(map(str, saved_iterations(root)))} are all incomplete)")
    return None, "none"


def check_checkpoint(cfg, root: str, iteration: Optional[int] = None) -> Optional[int]:
    """Read ``root``'s checkpoint metadata, compare it with ``cfg`` and check that every file is
    there with its saved size; no tensor is touched, no checksum computed (verify_checkpoint).

    Returns the iteration to resume from (``iteration``, else the tracker's, else the newest
    complete one; None: nothing to resume). Raises CheckpointError naming the file and every
    mismatching role/field. Runs on every rank before models exist.
    """
    if _megatron_checkpoint(cfg, root) is not None:
        return None  # the actor's weights (--load DIR --finetune), read when the models are built
    it, how = resume_iteration(root, iteration)
    if it is None:
        return None
    d = iter_dir(root, it)
    if how == "ckpt-step" and not os.path.isdir(d):
        raise CheckpointError(f"--ckpt-step {it}: {d} does not exist")
    path = os.path.join(d, METADATA)
    try:
        meta = _read_metadata(d)
        problems = _file_problems(d, meta)
    except CheckpointError as e:
        problems, meta = [str(e)], None
    if problems:
        source = {"tracker": f"named by {os.path.join(root, TRACKER)}", "ckpt-step": "given by --ckpt-step",
                  "scan": "the newest"}[how]
        raise CheckpointError(f"checkpoint iteration {it} ({source}) is damaged: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                              + f"; {_newest_other(root, it, lambda k: _complete(root, k))}")
    problems = run_problems(cfg, meta)
    if problems:
        raise CheckpointError(f"cannot resume from {path}: " + " | ".join(problems))
    _check_in_flight(cfg, os.path.join(d, TRAINER_STATE))
    return it


def in_flight_problem(state: Optional[dict], lag: int) -> Optional[str]:
    """Why a run at --rl-desired-lag ``lag`` cannot take the batches in flight that an overlapped
    run saved (trainer_state.json's ``overlap``: its lag and the batches generated, not trained),
    else None. Lag 0 trains them first; a lag of at least their count trains them in its first
    rounds while the generation pool goes on from the checkpoint's weights."""
    batches = (state or {}).get("batches") or []
    if not batches or lag == 0 or len(batches) <= lag:
        return None
    first, last = batches[0]["index"], batches[-1]["index"]
    return (f"the checkpoint holds {len(batches)} batches in flight (iterations {first}..{last}) of a run at "
            f"--rl-desired-lag {state.get('lag')}; this run's --rl-desired-lag {lag} trains at most {lag} behind "
            f"its generation and cannot take them: resume with --rl-desired-lag {state.get('lag')}, or 0 (the "
            f"batches in flight train first)")


def _check_in_flight(cfg, path: str) -> None:
    """Before any model is built: this run can take the checkpoint's batches in flight (--rl-desired-lag)."""
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            state = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    problem = in_flight_problem(state.get("overlap"), cfg.ppo.rl_desired_lag)
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}")


def _megatron_checkpoint(cfg, root: str):
    """The Megatron-LM checkpoint at ``root`` when this run reads it as the actor's weights
    (--load DIR --finetune: arguments made it the actor's --pretrained-checkpoint); None when
    ``root`` is not one. Any other use is a CheckpointError naming the format."""
    from puzzle.models.megatron_checkpoint import find_megatron_checkpoint

    found = find_megatron_checkpoint(root)
    if found is None:
        return None
    if cfg.finetune and cfg.roles["actor"].pretrained_checkpoint == root:
        return found
    raise CheckpointError(f"--load: {found.describe()} is a Megatron-LM checkpoint, not a puzzle run: read it "
                          f"with --finetune (the actor's and reference's weights) or --pretrained-checkpoint")


# ---- per-role sharded state dicts --------------------------------------------------------------
def _sharding_metadata(engine) -> dict:
    # the model's own DP group: without it megatron falls back to the (unset) global parallel_state
    return {"dp_cp_group": engine.layout.pg_collection.dp_cp,
            "distrib_optim_sharding_type": "fully_reshardable",
            "chained_optim_avoid_prefix": True, "singleton_local_shards": False}


def _role_sharded_state_dict(engine, *, is_loading: bool, with_optimizer: bool) -> dict:
    if not engine.member:
        return {}  # this rank holds no part of the model; the collective save/load still runs here
    metadata = _sharding_metadata(engine)
    if getattr(engine, "lora", None) is not None:  # the adapters alone: the frozen base is saved by reference
        from puzzle.models.lora import adapter_sharded_state_dict

        model_sd = adapter_sharded_state_dict(engine.module, engine.adapter_specs)
    else:  # TE's FP8 metadata is dropped so the local and transformer_engine specs load each other's files
        model_sd = drop_extra_state(engine.module.sharded_state_dict(prefix="", metadata=metadata))
    sd = {"model": model_sd}
    if with_optimizer and engine.optimizer is not None:
        if is_loading:
            _ensure_optimizer_state(engine.optimizer)
        sd["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                              metadata=metadata)
    return sd


def _ensure_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state to load into (megatron asserts on its
    'step' without apex/TE): create it with megatron's own zero-gradient dummy step; every value
    it touches (moments, fp32 main params, model weights) is then overwritten by the load."""
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(leaf, "_init_optimizer_states_with_dummy_values") and not leaf.optimizer.state:
            leaf._init_optimizer_states_with_dummy_values()


@torch.no_grad()
def weight_fingerprint(engine) -> list:
    """[sum, sum of squares] (float64) over the model's unique parameter shards, whole world; of a
    LoRA model's base (what it trains left out)."""
    from puzzle.models.lora import is_adapter_param

    acc = torch.zeros(2, dtype=torch.float64, device=runtime().device)
    if engine.member:
        lay, arch = engine.layout, engine.arch
        for name, p in engine.module.named_parameters():
            if is_adapter_param(name) or name in getattr(engine, "adapter_specs", {}):
                continue  # what a LoRA model trains: its adapters (a LoRA critic's value head too)
            if is_expert_param(name):  # experts: their expert-DP replicas count once
                if lay.edp != 0 or (lay.etp != 0 and not getattr(p, "tensor_model_parallel", False)):
                    continue
            elif lay.d != 0 or (lay.t != 0 and not getattr(p, "tensor_model_parallel", False)):
                continue  # DP replicas and TP-replicated tensors (norms, scalar heads) count once
            if (name == HEAD_LOCAL_NAME and not arch.untie_embeddings_and_output_weights
                    and ROLES[engine.role].lm_head and not lay.is_first_stage):
                continue  # the last stage's tied copy of the word embeddings
            x = p.detach().double()
            acc += torch.stack([x.sum(), (x * x).sum()])
    dist.all_reduce(acc)
    return [float(v) for v in acc]


# ---- save ------------------------------------------------------------------------------------------
def _maybe_fail(faults, rank: int, iteration: int) -> None:
    """The test fault config.FaultInjection.fail_save_at: this rank dies half way through this save."""
    if faults.fail_save_at == (rank, iteration):
        raise RuntimeError(f"injected fault (rank {rank}): simulated failure in the middle of saving "
                           f"iteration {iteration}")


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[checkpoint] {msg}", flush=True)


def _all_gather_objects(obj) -> list:
    """Every rank's ``obj`` (rank order), over the gloo object group."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj, group=runtime().object_group)
    return parts


def _checksum_files(d: str) -> Dict[str, list]:
    """Collective: {relative path: [size, sha256]} of every file under ``d``; each rank hashes
    every world_size-th file of the sorted list (files it or its peers have just written)."""
    names = None
    if dist.get_rank() == 0:
        names = sorted(os.path.relpath(os.path.join(dp, f), d) for dp, _, fs in os.walk(d) for f in fs)
    names = runtime().broadcast_object(names)
    mine = {rel: [os.path.getsize(os.path.join(d, rel)), _sha256(os.path.join(d, rel))]
            for i, rel in enumerate(names) if i % dist.get_world_size() == dist.get_rank()}
    parts = _all_gather_objects(mine)
    return {k: v for part in parts for k, v in sorted(part.items())}


def _delete_older(root: str, keep: int) -> None:
    for it in saved_iterations(root)[keep:]:
        shutil.rmtree(iter_dir(root, it), ignore_errors=True)
        print(f"[checkpoint] deleted {iter_dir(root, it)} (--keep-last-checkpoints {keep})", flush=True)


def save_checkpoint(parts: "Checkpointed", root: str, keep_last: Optional[int] = None) -> str:
    """Collective: write every rank's part of iteration ``parts.state.iteration`` under ``root``;
    ``keep_last``: then delete all but the newest ``keep_last`` checkpoints.

    A failure on any rank is a SaveError on that rank naming it and the phase (a failed write
    that megatron reports is one on every rank); the previous checkpoint stays the latest."""
    t0 = time.perf_counter()
    phase = SavePhases(parts.progress, parts.state.iteration, _still_latest(root))
    rank, it = phase.rank, parts.state.iteration
    final = iter_dir(root, it)
    tmp = final + ".tmp"
    trainable = [r for r, e in parts.engines.items() if e.trainable]
    with phase(f"creating {tmp}"):
        if rank == 0:
            if os.path.exists(tmp):  # left by a save that died
                shutil.rmtree(tmp)
            for sub in trainable + ["rng"]:
                os.makedirs(os.path.join(tmp, sub))
    dist.barrier()
    fingerprints = _write_parts(parts, tmp, trainable, phase)
    dist.barrier()  # every rank has written its files: checksum them, then the manifest
    with phase("checksumming the files"):
        files = _checksum_files(tmp)
    with phase(f"writing {METADATA}"):
        if rank == 0:
            meta = run_metadata(parts.cfg)
            for role, spec in meta["roles"].items():
                if "base" in spec:
                    spec["base"]["fingerprint"] = fingerprints.pop(role)
            meta["fingerprints"], meta["iteration"], meta["files"] = fingerprints, it, files
            with open(os.path.join(tmp, METADATA), "w") as f:
                json.dump(meta, f, indent=1)
    dist.barrier()  # every rank has written everything: publish
    with phase("publishing it"):
        if rank == 0:
            _publish(root, tmp, final, it)
    with phase("deleting older checkpoints"):
        if rank == 0 and keep_last:
            _delete_older(root, keep_last)
    dist.barrier()
    _log(f"saved iteration {it} to {final} in {time.perf_counter() - t0:.2f}s")
    return final


def _write_parts(parts: "Checkpointed", tmp: str, trainable: List[str], phase: SavePhases) -> dict:
    """Every rank's files of the checkpoint: each trainable role's dist checkpoint, its RNG file,
    and (rank 0) the trainer state. Returns the frozen roles' weight fingerprints (collective)."""
    from megatron.core import dist_checkpointing

    rank, it = phase.rank, phase.iteration
    for role in trainable:
        with phase(f"writing {role}"):
            sd = _role_sharded_state_dict(parts.engines[role], is_loading=False, with_optimizer=True)
            dist_checkpointing.save(sd, os.path.join(tmp, role))
            _maybe_fail(parts.cfg.faults, rank, it)
    with phase("writing the RNG states"):
        torch.save(capture_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    with phase("fingerprinting the frozen models"):
        fingerprints = {r: weight_fingerprint(e) for r, e in parts.engines.items()
                        if not e.trainable or getattr(e, "lora", None) is not None}  # a LoRA model: its base
    with phase(f"writing {TRAINER_STATE}"):
        if rank == 0:
            state = {**parts.state.state_dict(),
                     "loader": parts.loader.state_dict() if parts.loader is not None else None}
            with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
                json.dump(state, f, indent=1)
    return fingerprints


def _still_latest(root: str) -> str:
    """What a failed save leaves as the latest checkpoint (the one published before it began)."""
    try:
        latest = read_tracker(root)
    except CheckpointError:
        latest = None
    if latest is None:
        return f"no checkpoint under {root} is complete yet"
    return f"the latest checkpoint is still iteration {latest} ({iter_dir(root, latest)})"


def _publish(root: str, tmp: str, final: str, it: int) -> None:
    """Rank 0: ``tmp`` becomes ``final``, then the tracker names it (written whole, then renamed
    over the old one): the tracker only ever names a published directory."""
    if os.path.exists(final):  # a re-save of this iteration: the old copy goes aside, then away
        aside = final + ".old"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
    tracker = os.path.join(root, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(f"{it}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)


# ---- verify and load ------------------------------------------------------------------------------
def _verified(root: str, it: int) -> List[str]:
    """Collective: the problems of checkpoint ``it`` (checksums included); the ranks share the work."""
    d = iter_dir(root, it)
    try:
        meta = _read_metadata(d)
    except CheckpointError as e:
        return [str(e)]
    names = sorted(meta.get("files") or {})
    mine = names[dist.get_rank()::dist.get_world_size()]
    local = _file_problems(d, meta, files=mine, hashes=True) if names else _file_problems(d, meta)
    intact = [f for f in mine if not any(p.startswith(os.path.join(d, f) + ":") for p in local)]
    local += _rng_file_problems(d, intact)
    parts = _all_gather_objects(local if names or dist.get_rank() == 0 else [])
    return sorted({p for part in parts for p in part})


def _rng_file_problems(d: str, names: List[str]) -> List[str]:
    """Each RNG file of ``names`` that is not tensors and numbers only (read_rng_file)."""
    problems = []
    for rel in names:
        if re.fullmatch(r"rng/rank_\d+\.pt", rel.replace(os.sep, "/")):
            try:
                read_rng_file(os.path.join(d, rel))
            except CheckpointError as e:
                problems.append(str(e))
    return problems


def verify_checkpoint(root: str, iteration: Optional[int] = None) -> Optional[int]:
    """Collective, before the models are built: the iteration to resume (as check_checkpoint) with
    every file's checksum verified. Without a tracker the newest verified ``iter_*`` is taken (and
    the log says so); a damaged tracker-named or --ckpt-step checkpoint is a CheckpointError naming
    the file, the iteration and the newest intact checkpoint."""
    from puzzle.models.megatron_checkpoint import find_megatron_checkpoint

    t0 = time.perf_counter()
    if find_megatron_checkpoint(root) is not None:  # check_checkpoint let it through: --load DIR --finetune
        _log(f"{root} is a Megatron-LM checkpoint: the actor and reference start from its weights (--finetune)")
        return None
    it, how = resume_iteration(root, iteration)
    if it is None:
        _log(f"no checkpoint under {root}: starting from scratch")
        return None
    candidates = [it] + ([k for k in saved_iterations(root) if k < it] if how == "scan" else [])
    for k in candidates:
        problems = _verified(root, k)
        if not problems:
            if how == "scan":
                _log(f"no {TRACKER} under {root}: resuming from the newest complete and verified "
                     f"checkpoint, iteration {k}")
            _log(f"verified iteration {k} ({time.perf_counter() - t0:.2f}s)")
            return k
        if how == "scan":
            _log(f"skipping iteration {k}: {problems[0]}")
            continue
        other = _newest_other(root, k, lambda j: not _verified(root, j))
        raise CheckpointError(f"checkpoint iteration {k} is damaged: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                              + f"; {other}")
    raise CheckpointError(f"{root}: no {TRACKER} and no intact iter_* checkpoint")


def load_checkpoint(parts: "Checkpointed", root: str, *, load_optim: bool = True, load_rng: bool = True,
                    iteration: Optional[int] = None) -> int:
    """Collective: restore the latest checkpoint under ``root`` into ``parts``.

    Returns the restored iteration (0 when ``root`` has no checkpoint yet: a fresh start).
    Models and optimizers reshard to this run's layouts; with ``load_optim=False`` only weights
    (and the LR schedulers' step counts) are restored, as Megatron-LM's --no-load-optim. With the
    run's --finetune (Megatron-LM's meaning) only the trainable models' weights are read: no
    optimizer, RNG or run state, and the run starts at iteration 0.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    it = check_checkpoint(parts.cfg, root, iteration)
    if it is None:
        _log(f"no {TRACKER} under {root}: starting from scratch")
        return 0
    if parts.cfg.finetune:
        return _load_weights_only(parts, root, it, t0)
    d = iter_dir(root, it)
    meta = json.load(open(os.path.join(d, METADATA)))
    same_opt = meta["optimizer"]["use_distributed_optimizer"] == parts.cfg.optim.use_distributed_optimizer
    _check_lora_bases(parts, meta, os.path.join(d, METADATA))
    for role, eng in parts.engines.items():
        if not eng.trainable:
            continue
        try:  # torch's CheckpointException derives from BaseException, not Exception
            sd = _role_sharded_state_dict(eng, is_loading=True, with_optimizer=load_optim)
            state = dist_checkpointing.load(sd, os.path.join(d, role))
            if eng.member:
                _load_model_state(eng, state["model"])
                if load_optim:
                    # (megatron_patches.distrib_optimizer_step keeps Adam's "step" right on this path)
                    eng.optimizer.load_state_dict(state["optimizer"])  # fp32 main params included
                else:
                    _refresh_main_params(eng)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            hint = ("" if same_opt or not load_optim else
                    " (saved with use_distributed_optimizer="
                    f"{meta['optimizer']['use_distributed_optimizer']}, this run uses "
                    f"{parts.cfg.optim.use_distributed_optimizer}: retry with --no-load-optim)")
            raise CheckpointError(f"iteration {it}: loading {role} from {os.path.join(d, role)} failed"
                                  f"{hint}: {_summarize(e)}") from None
    for role, eng in parts.engines.items():  # frozen roles: rebuilt from their source; verify
        if eng.trainable:
            continue
        saved = meta.get("fingerprints", {}).get(role)
        now = weight_fingerprint(eng)
        if saved is not None and not fingerprints_match(saved, now):
            raise CheckpointError(f"{os.path.join(d, METADATA)}: frozen role {role} was rebuilt from "
                                  f"{meta['roles'][role]['source']} but its weights differ from the "
                                  f"saved run's (fingerprint {saved} vs {now})")
    state = json.load(open(os.path.join(d, TRAINER_STATE)))
    try:
        parts.state.load_state_dict(state)  # also drops the actor's generation copy: it follows the new weights
    except ValueError as e:
        raise CheckpointError(f"{os.path.join(d, TRAINER_STATE)}: {e}") from e
    if parts.loader is not None and state.get("loader") is not None:
        parts.loader.load_state_dict(state["loader"])
    if load_rng:
        path = os.path.join(d, "rng", f"rank_{dist.get_rank():05d}.pt")
        if meta["world_size"] != dist.get_world_size():
            _log(f"world size {meta['world_size']} -> {dist.get_world_size()}: RNG states not restored "
                 f"(sampling and shuffling are keyed by (seed, iteration), so numbers are unaffected)")
        else:
            _restore_rng(path)
    dist.barrier()
    _log(f"resumed iteration {it} from {d} in {time.perf_counter() - t0:.2f}s"
         + ("" if load_optim else " (weights only: --no-load-optim)"))
    return parts.state.iteration


def _check_lora_bases(parts: "Checkpointed", meta: dict, path: str) -> None:
    """Collective: each LoRA model's base (this run's weights) is the one its saved adapters were
    trained on (the fingerprint saved with them), else a CheckpointError naming both."""
    for role, eng in parts.engines.items():
        if getattr(eng, "lora", None) is None:
            continue
        problem = base_fingerprint_problem(meta, role, weight_fingerprint(eng), role_source(parts.cfg, role))
        if problem:
            raise CheckpointError(f"{path}: {problem}")


def _load_weights_only(parts: "Checkpointed", root: str, it: int, t0: float) -> int:
    """--finetune: the trainable models' weights of iteration ``it``, at this run's layouts."""
    d = iter_dir(root, it)
    _check_lora_bases(parts, _read_metadata(d), os.path.join(d, METADATA))
    for role, eng in parts.engines.items():
        if eng.trainable:
            try:
                load_role_weights(eng, os.path.join(d, role))
            except CheckpointError as e:
                raise CheckpointError(f"iteration {it} (--finetune): {e}") from None
            if eng.member:
                _refresh_main_params(eng)
    dist.barrier()
    _log(f"read the weights of iteration {it} from {d} in {time.perf_counter() - t0:.2f}s "
         f"(--finetune: no optimizer, RNG or run state; starting at iteration 0)")
    return parts.state.iteration


def _restore_rng(path: str) -> None:
    """Collective: this rank's RNG states from ``path``; a file that cannot be used is one
    CheckpointError on every rank (the first rank's message)."""
    problem = None
    try:
        state = read_rng_file(path)
    except CheckpointError as e:
        problem = str(e)
    if problem is None:
        try:
            set_rng_state(state)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            problem = f"{path}: unusable RNG states ({_first_line(e)}); resume without them with --no-load-rng"
    problems = [p for p in _all_gather_objects(problem) if p]
    if problems:
        raise CheckpointError(problems[0])


def _refresh_main_params(engine) -> None:
    """Weights-only load: copy the loaded model params into the optimizer's fp32 main params."""
    opt = engine.optimizer
    if hasattr(opt, "reload_model_params"):
        opt.reload_model_params()


# ---- one model's weights (tools, tests) ------------------------------------------------------------
def save_role_weights(engine, role_dir: str) -> None:
    """Collective: write the weights of one role model (no optimizer) as a dist checkpoint, in the
    same format as a role directory of save_checkpoint (any layout loads it)."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(role_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_role_sharded_state_dict(engine, is_loading=False, with_optimizer=False), role_dir)


def load_role_weights(engine, role_dir: str) -> None:
    """Collective: fill one role model's weights from a role directory of a checkpoint (e.g.
    ``iter_0000010/actor``) saved at any layout, with either transformer implementation."""
    from megatron.core import dist_checkpointing

    sd = _role_sharded_state_dict(engine, is_loading=True, with_optimizer=False)
    try:
        state = dist_checkpointing.load(sd, role_dir)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        raise CheckpointError(f"loading {engine.role} weights from {role_dir} failed: {_summarize(e)}") from None
    if engine.member:
        _load_model_state(engine, state["model"])


def _load_model_state(engine, state: dict) -> None:
    """A loaded model state into ``engine``'s module: a LoRA model's adapters, else every weight."""
    if getattr(engine, "lora", None) is not None:
        from puzzle.models.lora import load_adapter_state

        try:
            load_adapter_state(engine.module, engine.adapter_specs, state)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint does not fit the LoRA adapters: {e}") from None
        return
    _load_module_state(engine.module, state)


def _load_module_state(module, state: dict) -> None:
    """``load_state_dict`` that tolerates only TE's absent ``_extra_state`` (see param_names)."""
    res = module.load_state_dict(state, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
    if missing or res.unexpected_keys:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                              f"unexpected {list(res.unexpected_keys)[:5]}")
