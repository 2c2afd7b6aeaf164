"""Several students trained alike from different seeds, answering with their averaged probabilities.

A student learns from released labels and public inputs only, so training more of them and
averaging is free post-processing. Their mistakes are partly independent (different initial
weights, batch orders and augmentations), so the average errs less often than a member: on the
demo's public proxy, three members beat one by 1.1 points (docs/main-job.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from conclave.errors import InvalidValue


class AveragedStudents(nn.Module):
    """``forward``: the log of the members' mean softmax (so argmax and cross-entropy read it as
    logits); ``features``: the first member's, the embedding a later round uses."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise InvalidValue("AveragedStudents needs at least one member")
        self.members = nn.ModuleList(members)

    @property
    def first(self) -> nn.Module:
        return self.members[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.stack([torch.softmax(member(x), dim=1) for member in self.members]).mean(dim=0)
        return torch.log(probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.first.features(x)
