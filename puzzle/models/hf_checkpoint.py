"""HF checkpoints of the LLaMA-family decoders (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3): import into
and export from role models at any (P, D, T) layout.

Import (``load_hf_into_model``): every rank opens the safetensors files lazily (``safe_open``,
through ``model.safetensors.index.json`` when sharded) and reads ONLY the rows/columns of its own
shards with ``get_slice`` — the fused QKV shard is assembled from the q/k/v rows of the query
groups that rank holds, the SwiGLU fc1 shard from its gate and up chunks, the vocab shard from
its embedding rows (padding rows are zero). The name/shape mapping lives in
puzzle/models/hf_mapping.py (the one table).

Export (``export_hf``): collective over the default process group. The ranks of data-parallel
replica 0 send their shards to global rank 0 (``gather_object``), which reassembles whole tensors
from the layout description (shard_slices), maps them to HF names and writes ``config.json`` +
safetensors (sharded with an index above ``max_shard_bytes``). Simple, O(model) memory on rank 0.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch

from puzzle.config import ROLES, ModelArch
from puzzle.models.hf_mapping import (HEAD_NAMES, UnsupportedHFModel, arch_from_hf_config,
                                      assemble, hf_config_from_arch, hf_entries, ours_to_hf)
from puzzle.models.init import dp_replica, layout_spec_name, param_specs, tp_split
from puzzle.models.lora import is_adapter_param
from puzzle.models.param_layout import resolve_layers_per_stage, shard_slices

__all__ = ["HFCheckpoint", "arch_from_hf_dir", "arch_from_hf_config", "load_hf_into_model", "export_hf",
           "UnsupportedHFModel", "hf_config_from_arch"]

_EMBED = "embedding.word_embeddings.weight"


def _config_path(hf_dir: str) -> str:
    path = os.path.join(os.fspath(hf_dir), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no HF config.json (is {hf_dir!r} an HF model directory?)")
    return path


def arch_from_hf_dir(hf_dir: str, **overrides) -> ModelArch:
    """ModelArch from ``hf_dir/config.json`` (see hf_mapping.arch_from_hf_config)."""
    path = _config_path(hf_dir)
    with open(path) as f:
        return arch_from_hf_config(json.load(f), source=path, **overrides)


class HFCheckpoint:
    """Lazy reader of the safetensors of an HF directory (one file, or sharded with an index)."""

    def __init__(self, hf_dir: str):
        self.dir = os.fspath(hf_dir)
        index = os.path.join(self.dir, "model.safetensors.index.json")
        single = os.path.join(self.dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map: Dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json "
                                    f"(only safetensors checkpoints are supported)")
        self._handles = {}
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: no tensor {name!r} in the checkpoint")
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.dir, fname), framework="pt")
        return self._handles[fname]

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, box) -> torch.Tensor:
        """Rows/columns ``box`` (one (start, stop) per dim) of tensor ``name``, read alone."""
        sl = self._handle(name).get_slice(name)
        shape = sl.get_shape()
        if len(shape) != len(box) or any(b > s for (_, b), s in zip(box, shape)):
            raise ValueError(f"{self.dir}: tensor {name} has shape {tuple(shape)}, cannot read {box}")
        t = sl[tuple(slice(a, b) for a, b in box)]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self):
        self._handles.clear()


def _prefix(ckpt: HFCheckpoint) -> str:
    if "model.embed_tokens.weight" in ckpt or any(k.startswith("model.layers.") for k in ckpt.weight_map):
        return "model."
    return ""


def _head_name(ckpt: HFCheckpoint) -> Optional[str]:
    for n in HEAD_NAMES:
        if n in ckpt:
            return n
    return None


@torch.no_grad()
def load_hf_into_model(module: torch.nn.Module, arch: ModelArch, role: str, hf_dir: str, *,
                       allow_missing_head: bool = False) -> Dict[str, int]:
    """Fill this rank's shards of ``module`` (built by build_role_model) from an HF directory.

    Not collective: each rank reads only the HF rows/columns of its own shards. Critic/reward
    heads come from ``score.weight`` or ``v_head.weight``; with ``allow_missing_head`` a
    checkpoint without one (e.g. a critic started from an LM) keeps the module's current head.
    Returns {"tensors": parameters filled, "bytes_read": bytes read from disk}.
    """
    if module is None:
        return {"tensors": 0, "bytes_read": 0}
    layout = module.puzzle_layout
    plan = layout.plan
    ckpt = HFCheckpoint(hf_dir)
    head = _head_name(ckpt)
    lm = ROLES[role].lm_head
    if not lm and head is None and not allow_missing_head:
        raise KeyError(f"{hf_dir}: {role} needs a value/score head ({' or '.join(HEAD_NAMES)}) in the "
                       f"checkpoint; pass allow_missing_head=True to keep the initialised head")
    if lm and arch.untie_embeddings_and_output_weights and "lm_head.weight" not in ckpt:
        raise KeyError(f"{hf_dir}: untied model needs lm_head.weight (tie_word_embeddings false?)")
    entries = {e.ours: e for e in hf_entries(arch, role, prefix=_prefix(ckpt),
                                             head_name=head or HEAD_NAMES[0])}
    specs = {s.name: s for s in param_specs(arch, role)}
    emb_hf = entries[_EMBED].hf[0]
    if emb_hf in ckpt and ckpt.shape(emb_hf) != (arch.vocab_size, arch.hidden_size):
        raise ValueError(f"{hf_dir}: {emb_hf} has shape {ckpt.shape(emb_hf)}, the arch expects "
                         f"({arch.vocab_size}, {arch.hidden_size})")
    lps = resolve_layers_per_stage(arch.num_layers, plan.P)
    filled = 0
    for local, param in module.named_parameters():
        if is_adapter_param(local):
            continue  # LoRA adapters keep their initial values over the loaded base
        name = layout_spec_name(local, role, arch, layout, lps)
        if name not in specs:
            raise KeyError(f"{role}: parameter {local} (global {name}) has no layout description")
        if name == "value_head.weight" and head is None:
            continue  # allow_missing_head
        spec, entry = specs[name], entries[name]
        parts = [assemble(entry, box, arch, ckpt.read, dtype=param.dtype)
                 for box in shard_slices(spec, *tp_split(name, layout))]
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.split_dim)
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeError(f"{role}: {local} local shape {tuple(param.shape)} != HF-built "
                               f"{tuple(value.shape)} at plan {plan}")
        param.copy_(value)
        filled += 1
    stats = {"tensors": filled, "bytes_read": ckpt.bytes_read}
    ckpt.close()
    return stats


# ---- export --------------------------------------------------------------------------------------
def _local_shards(module, arch: ModelArch, role: str) -> Optional[dict]:
    """{spec name: (ways, index, local tensor)} of the shards this rank holds in replica 0 (DP
    replica 0 for dense parameters, expert-DP replica 0 for experts), else None."""
    if module is None:
        return None
    layout = module.puzzle_layout
    lps = resolve_layers_per_stage(arch.num_layers, layout.plan.P)
    out = {}
    for local, param in module.named_parameters():
        name = layout_spec_name(local, role, arch, layout, lps)
        if name == _EMBED and not layout.is_first_stage:
            continue  # the tied copy on the last stage; the first stage's is the original
        if dp_replica(name, layout) != 0:
            continue
        out[name] = tp_split(name, layout) + (param.detach().cpu().clone(),)
    return {"shards": out} if out else None


def gather_full_state(module, arch: ModelArch, role: str, dst: int = 0) -> Optional[Dict[str, torch.Tensor]]:
    """Whole tensors {global spec name: tensor} on rank ``dst`` (None elsewhere). Collective over
    the default group; ranks outside the model's layout pass ``module=None``."""
    import torch.distributed as dist

    mine = _local_shards(module, arch, role)
    if dist.is_initialized() and dist.get_world_size() > 1:
        got = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, got, dst=dst)
        if dist.get_rank() != dst:
            return None
    else:
        got = [mine]
    got = [g for g in got if g is not None]
    if not got:
        raise RuntimeError(f"{role}: no rank holds the model")
    full = {}
    for spec in param_specs(arch, role):
        held = [g["shards"][spec.name] for g in got if spec.name in g["shards"]]
        T = held[0][0] if held else 0
        by_t = {t: shard for _, t, shard in held}
        if not held or len(by_t) != T:
            raise RuntimeError(f"{role}: {spec.name}: shards of TP ranks {sorted(by_t)} of T={T} arrived")
        out = torch.empty(spec.global_shape, dtype=by_t[0].dtype)
        for t, shard in by_t.items():
            boxes = shard_slices(spec, T, t)
            k = spec.split_dim or 0
            off = 0
            for box in boxes:
                n = box[k][1] - box[k][0]
                out[tuple(slice(a, b) for a, b in box)] = shard.narrow(k, off, n)
                off += n
        full[spec.name] = out
    return full


def hf_tensors_from_full(full: Dict[str, torch.Tensor], arch: ModelArch, role: str,
                         head_name: str = "score.weight") -> Dict[str, torch.Tensor]:
    """Our whole tensors -> HF LLaMA tensors (tied LM: no lm_head.weight, as HF saves it)."""
    out = {}
    for entry in hf_entries(arch, role, head_name=head_name):
        out.update(ours_to_hf(entry, full[entry.ours], arch))
    return out


def _write_safetensors(tensors: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> List[str]:
    from safetensors.torch import save_file

    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_hf(module, arch: ModelArch, role: str, out_dir: str, *, dtype: Optional[str] = None,
              head_name: str = "score.weight", max_shard_bytes: int = 5 * 2 ** 30,
              config_extra: Optional[dict] = None) -> Optional[List[str]]:
    """Write ``out_dir/config.json`` + safetensors of a role model at any layout.

    Collective over the default process group (ranks outside the layout pass module=None);
    rank 0 writes and returns the list of files written, other ranks return None.
    ``dtype``: float32 / bfloat16 / float16 for the saved tensors (default: the params' dtype).
    """
    full = gather_full_state(module, arch, role, dst=0)
    if full is None:
        return None
    tensors = hf_tensors_from_full(full, arch, role, head_name=head_name)
    if dtype is None:
        dtype = {v: k for k, v in _DTYPES.items()}[next(iter(tensors.values())).dtype]
    tensors = {k: v.to(_DTYPES[dtype]) for k, v in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    files = _write_safetensors(tensors, out_dir, max_shard_bytes)
    cfg = hf_config_from_arch(arch, role, dtype=dtype, **(config_extra or {}))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return ["config.json"] + files
