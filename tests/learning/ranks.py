"""Owners' ranks of a data-parallel run in processes of their own, forked from one server process
that imported torch (with the ``torch._dynamo`` its optimizers load), Opacus and the DP-SGD code once
for the session: each rank would otherwise import them itself, seconds of CPU apiece
(``test_secure_dpsgd``, ``test_finite_clipping``)."""
from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "opacus", "conclave.learning.dpsgd",
           "conclave.learning.secure_dpsgd", "conclave.learning.models.table", "conclave.privacy.secure_sum"]


def run_ranks(rank: Callable[..., None], args: tuple, ranks: int = 2) -> None:
    """``rank(i, *args)`` for i < ``ranks``, each in a fresh process; raises if any fails."""
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts: the session's first call
    mp.start_processes(rank, args=args, nprocs=ranks, start_method="forkserver")
