"""Start a test's gloo ranks as processes: `torch.multiprocessing.start_processes`, joined, with the start method of
the course's worker processes (`zero_core.stage_pool.worker_context`): forked from a server that imported torch once,
where `mp.spawn` would start each rank as a fresh interpreter that imports torch again (about 1.5 s of CPU a rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp

from zero_core.stage_pool import worker_context


def start_ranks(rank_main: Callable[..., None], args: tuple, world_size: int) -> None:
    """`rank_main(rank, *args)` in `world_size` processes; raises if any of them fails."""
    start_method = worker_context().get_start_method()
    mp.start_processes(rank_main, args=args, nprocs=world_size, join=True, start_method=start_method)
