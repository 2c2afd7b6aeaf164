"""Where a run leaves its evidence: ``results/<run>/`` with config, metrics and privacy JSON."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not np.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return value


class RunDirectory:
    """One run's output folder; every file is JSON a machine can read back."""

    def __init__(self, root: str | Path, run_name: str) -> None:
        self.path = Path(root) / run_name
        self.path.mkdir(parents=True, exist_ok=True)

    def write_json(self, name: str, payload: Any) -> Path:
        target = self.path / f"{name}.json"
        target.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=True) + "\n")
        log.info("wrote %s", target)
        return target

    def plot(self, name: str, x: list[float], ys: dict[str, list[float]], xlabel: str, ylabel: str) -> Path:
        """A line plot of one or more series against ``x``, saved as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for label, y in ys.items():
            ax.plot(x[: len(y)], y, marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(ys) > 1:
            ax.legend()
        target = self.path / f"{name}.png"
        fig.tight_layout()
        fig.savefig(target, dpi=120)
        plt.close(fig)
        return target
