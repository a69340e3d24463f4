"""The bundled profile ``profiles/a100_80gb.json``: its layer tables, rewritten from its own
hardware constants (``python -m puzzle.plan_search.bundled_profile``)."""

from __future__ import annotations

import os
from typing import Optional

from puzzle.plan_search.cost_model import LLAMA_SHAPES
from puzzle.plan_search.profile_data import PROFILE_DIR, Profile, analytic_layer_table, load_profile, save_profile, shape_key


def regenerate_bundled(path: Optional[str] = None) -> Profile:
    """Rewrite ``profiles/a100_80gb.json``'s layer tables from its own hardware constants and the
    LLaMA shapes of PUZZLE Table 1 (+ LLaMA-2-70B). Used once to write the bundled file."""
    path = path or os.path.join(PROFILE_DIR, "a100_80gb.json")
    prof = load_profile(path)
    prof.layers = {}
    for name, shape in LLAMA_SHAPES.items():
        if shape_key(shape) not in prof.layers:
            prof.layers[shape_key(shape)] = analytic_layer_table(shape, prof, name=name)
    save_profile(prof, path)
    return prof


if __name__ == "__main__":  # python -m puzzle.plan_search.bundled_profile: regenerate the bundled tables
    p = regenerate_bundled()
    print(f"wrote {len(p.layers)} layer tables to {os.path.join(PROFILE_DIR, 'a100_80gb.json')}")
