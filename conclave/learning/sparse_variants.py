"""The names of the sparse fine-tuning variants (``learning.sparse`` says what each trains).

Apart from the torch code so that a config naming them loads, and ``conclave plan`` prices
its DP-SGD schedules, without torch.
"""
from __future__ import annotations

VARIANTS = ("classifier", "classifier+norm", "all", "whole")
