"""The training report: report.json and PNG plots, rendered to bytes.

The job hands them to ``write_artifact`` as extra files, so they land in the artifact
directory in the same atomic rename as the model itself.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch


def json_bytes(payload: dict) -> bytes:
    text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False, default=_json_default)
    return text.encode("utf-8")


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def peak_memory_mib(device: str) -> dict:
    """{"peak_memory_mib": this process's peak resident memory so far (VmHWM, Linux), and
    "peak_gpu_memory_mib" when the fit ran on CUDA}; what cannot be read is left out."""
    out = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    out["peak_memory_mib"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    if device.startswith("cuda"):
        out["peak_gpu_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def plot_objective(history: list[dict], objective_name: str) -> bytes:
    """Objective per iteration, with validation accuracy on a second axis when recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    its = [h["iteration"] for h in history]
    ax.plot(its, [h["objective"] for h in history], color="tab:blue", label=objective_name)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"{objective_name} (mean per point)", color="tab:blue")
    val = [(h["iteration"], h["val_accuracy"]) for h in history if "val_accuracy" in h]
    if val:
        ax2 = ax.twinx()
        ax2.plot(*zip(*val, strict=True), "o-", color="tab:orange", label="validation accuracy")
        ax2.set_ylabel("validation kNN accuracy", color="tab:orange")
    ax.set_title("training objective")
    fig.tight_layout()
    return _png(fig)


def plot_embedding(z: np.ndarray, y: np.ndarray, classes: list, title: str) -> bytes:
    """2-D scatter of embeddings coloured by class (first two principal axes when d > 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    z = np.asarray(z, dtype=np.float64)
    if z.shape[1] > 2:
        centred = z - z.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        z2 = centred @ vt[:2].T
        axes = ("PC 1 of embedding", "PC 2 of embedding")
    elif z.shape[1] == 2:
        z2, axes = z, ("z1", "z2")
    else:
        z2, axes = np.column_stack([z[:, 0], np.zeros(len(z))]), ("z1", "")
    fig, ax = plt.subplots(figsize=(6, 5))
    cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
    for i, c in enumerate(classes):
        mask = y == i
        if mask.any():
            ax.scatter(z2[mask, 0], z2[mask, 1], s=8, color=cmap(i % cmap.N), label=str(c))
    ax.set_xlabel(axes[0])
    ax.set_ylabel(axes[1])
    ax.set_title(title)
    if len(classes) <= 20:
        ax.legend(markerscale=2, fontsize=7, loc="best")
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
