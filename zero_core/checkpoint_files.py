"""The files of a sharded checkpoint, as exercise 10 asks for them: one per rank, and what is read from them.

A ZeRO checkpoint is N files, one per rank, each holding what that rank owns, as DeepSpeed writes its
`zero_pp_rank_{r}_mp_rank_00_optim_states.pt` files. What the course (and the grader) reads of a rank file is
fixed here, so that any answer can be checked and any two answers' files compared; everything else in a file
is the writer's choice:

- `rank_file(directory, rank)`: the file's name;
- a dict, loadable by `torch.load(..., weights_only=True)` (tensors, numbers, strings, lists, dicts), with
  `"step"`, Adam's step count, and `"shards"`: {"master", "m", "v"}, each one flat fp32 tensor holding the
  rank's owned elements of every layer, in layer order, without padding (`STATES`).

A consolidated state (what `consolidate` returns, as DeepSpeed's `zero_to_fp32.py` rebuilds fp32 weights) is
{"step": int, "master": {layer: flat fp32}, "m": {...}, "v": {...}}, each layer flattened weight then bias.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

STATES = ("master", "m", "v")
"""The fp32 optimizer states every element has: master weight, Adam's first and second moment (`AdamShard`'s
attributes of the same names)."""


def rank_file(directory: str | Path, rank: int) -> Path:
    """Rank `rank`'s file, named like DeepSpeed's `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`."""
    return Path(directory) / f"zero_pp_rank_{rank}_states.pt"


def read_rank_file(directory: str | Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s file, its tensors on the CPU (plain tensors and numbers only: `weights_only`)."""
    return torch.load(rank_file(directory, rank), map_location="cpu", weights_only=True)
