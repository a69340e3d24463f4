"""Sample from a model: prompts JSONL in, JSONL out (``prompt``, ``response``, ``tokens``).

The model is an HF directory (Llama-2/3.x, Mistral, Qwen2/2.5, Qwen3) or a puzzle checkpoint
(``train_ppo.py --save`` root; ``--role`` picks the model, ``--ckpt-step`` the iteration), run at
any (P, D, T): prompts are split over the D data-parallel replicas, and the output is the same
at every layout (greedy) or for a given ``--seed`` (sampled: the random stream of each prompt
depends only on the seed and the prompt's index).

    python -m puzzle.tools.generate --load /ckpt/Qwen2.5-0.5B-Instruct --prompts in.jsonl \\
        --output out.jsonl --apply-chat-template --greedy --max-new-tokens 128
    torchrun --standalone --nproc-per-node 4 -m puzzle.tools.generate --load runs/ppo/ckpt \\
        --tokenizer-model /ckpt/sft --prompts in.jsonl --output out.jsonl \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --temperature 0.7 --top-p 0.9

Each input line is an object with ``prompt`` (a string, or a list of chat messages with
``--apply-chat-template``; ``--prompt-key`` renames it) or ``prompt_ids`` (token ids). Each output
line repeats the prompt and adds ``response`` (decoded, special tokens skipped) and ``tokens``
(the response's ids, up to and including the stop id). Stop ids come from the tokenizer
directory's ``generation_config.json`` (several allowed), else the tokenizer's eos.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from typing import List

from puzzle.tools.model_source import add_source_args


def _parser() -> argparse.ArgumentParser:
    from puzzle.arguments import RaisingArgumentParser

    p = RaisingArgumentParser(prog="python -m puzzle.tools.generate", description=__doc__.split("\n\n")[0],
                              allow_abbrev=False)
    add_source_args(p)
    g = p.add_argument_group("model")
    g.add_argument("--seq-length", type=int, default=None,
                   help="longest prompt + response (HF source; default max_position_embeddings)")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--micro-batch-size", type=int, default=None, help="prompts per generation micro-batch")
    g = p.add_argument_group("data")
    g.add_argument("--prompts", required=True, help="input JSONL")
    g.add_argument("--output", required=True, help="output JSONL (written by rank 0)")
    g.add_argument("--prompt-key", default="prompt")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--tokenizer-type", default=None,
                   help="default: HuggingFaceTokenizer of --load when it has tokenizer files, else ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer directory (default: --load)")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--greedy", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    return p


def _tokenizer(args):
    from puzzle.data.tokenizers import build_tokenizer

    ttype, tmodel = args.tokenizer_type, args.tokenizer_model
    if ttype is None:
        has_files = any(os.path.isfile(os.path.join(tmodel or args.load, f))
                        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        ttype = "HuggingFaceTokenizer" if has_files else "ByteLevelTokenizer"
    if ttype == "HuggingFaceTokenizer" and tmodel is None:
        tmodel = args.load
    return build_tokenizer(ttype, tmodel)


def read_prompts(path: str, tokenizer, key: str = "prompt", chat: bool = False):
    """(records, token-id prompts) of a prompts JSONL (see the module docstring)."""
    records, ids = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt_ids" in rec:
                toks = [int(t) for t in rec["prompt_ids"]]
            elif key in rec:
                text = rec[key]
                if chat:
                    msgs = [{"role": "user", "content": text}] if isinstance(text, str) else text
                    toks = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
                elif isinstance(text, str):
                    toks = tokenizer.encode(text, add_bos=getattr(tokenizer, "bos_id", None) is not None)
                else:
                    raise ValueError(f"{path}:{n}: {key!r} is not a string (chat messages need "
                                     f"--apply-chat-template)")
            else:
                raise ValueError(f"{path}:{n}: no {key!r} or 'prompt_ids' field")
            if not toks:
                raise ValueError(f"{path}:{n}: empty prompt")
            records.append(rec)
            ids.append(toks)
    if not ids:
        raise ValueError(f"{path}: no prompts")
    return records, ids


def _generate(argv) -> int:
    from puzzle.tools.model_source import (apply_patches, end_world, load_engine, plan_from_flags, source_arch,
                                           start_world)

    apply_patches()
    args = _parser().parse_args(argv)
    from puzzle.config import ROLES
    from puzzle.config_flags import ArgumentError

    if not ROLES[args.role].lm_head:
        raise ArgumentError(f"--role: generation needs an LM (actor or ref), got {args.role}")
    plan = plan_from_flags(args)  # every input is checked before the process group starts
    arch = source_arch(args.load, args.role, plan, step=args.ckpt_step, seq_length=args.seq_length,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    tokenizer = _tokenizer(args)
    records, prompts = read_prompts(args.prompts, tokenizer, args.prompt_key, args.apply_chat_template)
    from puzzle.data.tokenizers import fit_to_rows

    # generation samples only the tokenizer's ids that have rows (ModelArch.valid_vocab_size); ids
    # beyond the rows (an added pad) are fine unless a prompt, BOS or a stop id would feed them
    arch = replace(arch, tokenizer_vocab_size=tokenizer.vocab_size)
    fit_to_rows(tokenizer, arch.vocab_size, prompts, source=args.prompts)
    from puzzle.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                            eos_id=tokenizer.eos_id, eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id)
    rank, owns_world = start_world(args.distributed_backend)
    import torch.distributed as dist

    from puzzle.rollout.generation import generate

    engine = load_engine(args.load, args.role, plan, arch, step=args.ckpt_step, bf16=args.bf16,
                         transformer_impl=args.transformer_impl)
    lay = engine.layout
    part, parts = plan.generation_share(rank)  # the ranks of an expert-parallel group generate together
    share = math.ceil(len(prompts) / parts)
    lo = part * share
    mine = prompts[lo:lo + share]
    rows: List[tuple] = []
    if mine:
        out = generate(engine, mine, params, seed=args.seed, micro_batch_size=args.micro_batch_size,
                       sample_offset=lo)
        if lay.p == 0 and lay.t == 0 and lay.d == part * (plan.D // parts):
            rows = [(lo + i, r) for i, r in enumerate(out.responses())]
    got = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(rows, got, dst=0)
    if rank == 0:
        by_index = dict(r for part in got for r in part)
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            for i, rec in enumerate(records):
                toks = by_index[i]
                text = [t for t in toks if t not in tokenizer.eos_ids]
                f.write(json.dumps({"prompt": rec.get(args.prompt_key, rec.get("prompt_ids")),
                                    "response": tokenizer.decode(text), "tokens": toks}) + "\n")
        print(f"generate: {len(records)} prompts from {args.load} at {plan} -> {args.output}", flush=True)
    end_world(owns_world)
    return 0


def main(argv=None) -> int:
    """Bad input: one ``error:`` line from rank 0 and exit status 2 (as train_ppo.py)."""
    from puzzle.fail_fast import run_failing_fast

    return run_failing_fast(_generate, argv)


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
