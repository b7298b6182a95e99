"""Plots of a run: loss curves and attention maps (matplotlib, Agg backend, PNG files).

A `Plotter` draws both in a child Python process (this file run as a script, which imports
NumPy and matplotlib but not torch or the rest of the package), so that a caller can go on
with other work on another core meanwhile.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

__all__ = ["plot_loss", "plot_attention", "Plotter"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(metrics: list[dict], path: str | Path):
    """Plot train and validation loss (nats) against step from metrics.jsonl records.

    Args:
        metrics: dicts with "step" and "train_loss" and, on evaluation steps, "val_loss"
            (and "probe_second_half_loss", drawn when present on its own right-hand axis:
            it starts near ln(vocab_size), far above the other two).
        path: the PNG file to write.

    Returns:
        the (closed) matplotlib Figure: axes[0] train and validation, axes[1] the probe (when
        drawn).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    train = [(m["step"], m["train_loss"]) for m in metrics if "train_loss" in m]
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    probe = [
        (m["step"], m["probe_second_half_loss"]) for m in metrics if "probe_second_half_loss" in m
    ]
    handles = ax.get_lines()
    if probe:  # falls when induction heads form
        right = ax.twinx()
        handles += right.plot(
            *zip(*probe, strict=True), "s--", color="C2", label="repeated probe, 2nd half (right)"
        )
        right.set_ylabel("repeated probe, 2nd half (nats per token)", color="C2")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats per token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, labels=[h.get_label() for h in handles])
    right_margin = 0.8 if probe else 0.15
    fig.subplots_adjust(
        left=0.8 / 7, right=1 - right_margin / 7, bottom=0.55 / 4.5, top=1 - 0.35 / 4.5
    )
    fig.savefig(path, dpi=110)  # fixed margins: tight_layout would draw the figure twice
    plt.close(fig)
    return fig


def _checked_maps(att) -> np.ndarray:
    """att as an array; ValueError unless it is [n_layers, n_heads, T, T]."""
    att = np.asarray(att)
    if att.ndim != 4 or att.shape[-1] != att.shape[-2]:
        raise ValueError(f"att must be [n_layers, n_heads, T, T], got shape {att.shape}")
    return att


def plot_attention(att: np.ndarray, path: str | Path, title: str = ""):
    """Draw every layer's and head's attention map in one grid (rows: layers, columns: heads).

    Args:
        att: [n_layers, n_heads, T, T] probabilities; att[l, h, t, s] is the weight of key
            position s for query position t.
        path: the PNG file to write.
        title: a figure title (for example the text of the window).

    Returns:
        the (closed) matplotlib Figure; its axes are in row-major (layer, head) order, then
        the colour scale (0 to 1, shared by every map).

    Raises:
        ValueError: att is not 4-D with square maps.
    """
    att = _checked_maps(att)
    n_layers, n_heads = att.shape[:2]
    plt = _pyplot()
    fig, axes = plt.subplots(
        n_layers, n_heads, figsize=(2.6 * n_heads + 0.6, 2.6 * n_layers + 0.6), squeeze=False
    )
    from matplotlib.ticker import MaxNLocator

    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer][head]
            image = ax.imshow(
                att[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest"
            )
            ax.set_title(f"layer {layer}, head {head}", fontsize=9)
            ax.set_xlabel("key position", fontsize=8)
            ax.set_ylabel("query position", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if title:  # shown literally: "$" would start matplotlib's math mode
        fig.suptitle(title.replace("$", r"\$"), fontsize=9)
    # fixed margins in inches: tight_layout would draw the whole grid once more to measure it
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=0.6 / width,
        right=1 - 0.9 / width,
        bottom=0.5 / height,
        top=1 - (0.55 if title else 0.35) / height,
        wspace=0.4,
        hspace=0.45,
    )
    scale = fig.add_axes((1 - 0.7 / width, 0.5 / height, 0.15 / width, 1 - 1.2 / height))
    fig.colorbar(image, cax=scale, label="attention weight")  # one scale: every map is 0 to 1
    with warnings.catch_warnings():  # characters the font lacks are drawn as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        fig.savefig(path, dpi=90)
    plt.close(fig)
    return fig


class Plotter:
    """A child Python process that imports matplotlib now and draws a run's two plots when
    given them: `draw(...)` sends them and returns at once, `wait()` returns once both PNG
    files are written, `close()` ends it (drawn or not; also when the parent dies, as its
    input then ends). The child runs this file as a script (`python -P`, so that this
    file's directory does not shadow other packages): NumPy and matplotlib only, no torch.
    It ignores SIGINT: a Ctrl-C is the parent's to handle.
    """

    def __init__(self):
        self.work = None  # the directory that hands over the attention maps, made by draw()
        self.process = subprocess.Popen(
            [sys.executable, "-P", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def draw(
        self, metrics: list[dict], loss_path: str | Path, att, att_path: str | Path, title=""
    ) -> None:
        """Start `plot_loss(metrics, loss_path)` and `plot_attention(att, att_path, title)`
        in the child (arguments as for those; att is checked here).

        Raises:
            ValueError: att is not [n_layers, n_heads, T, T].
            RuntimeError: the child process has failed already (see `wait`).
        """
        att = _checked_maps(att)
        self.work = tempfile.mkdtemp(prefix="decoderlm-plots-")
        np.save(Path(self.work) / "att.npy", att)
        job = {"metrics": metrics, "loss": str(loss_path), "att": str(att_path), "title": title}
        job["work"] = self.work
        try:
            self.process.stdin.write(json.dumps(job).encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # the child has ended already: wait() says why
            self.wait()
            raise RuntimeError("drawing the plots failed: the plots' process ended early") from None

    def wait(self) -> None:
        """Wait for the plots (or for the child to end, when nothing was drawn).

        Raises:
            RuntimeError: the child process failed (the message ends with its last line
                of error output).
        """
        try:
            _, err = self.process.communicate()
        finally:
            self._clean()
        if self.process.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or ["no error output"])[-1]
            raise RuntimeError(f"drawing the plots failed: {last}")

    def close(self) -> None:
        """End the child whatever it was doing (a no-op once it has ended)."""
        if self.process.returncode is None:
            self.process.kill()
            self.process.communicate()
        self._clean()

    def _clean(self) -> None:
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)


def _serve() -> None:
    """The child process of `Plotter`: import matplotlib, then draw the job read from stdin
    (none when stdin ends first)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _pyplot()
    line = sys.stdin.readline()
    if line:
        job = json.loads(line)
        plot_loss(job["metrics"], job["loss"])
        att = np.load(Path(job["work"]) / "att.npy")
        plot_attention(att, job["att"], title=job["title"])


if __name__ == "__main__":
    _serve()
