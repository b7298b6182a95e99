import numpy as np
import pytest

from decoderlm.lens.plots import plot_attention, plot_loss


@pytest.mark.parametrize("n_layers,n_heads", [(3, 2), (2, 3)])
def test_attention_plot_has_one_labelled_panel_per_layer_and_head(tmp_path, n_layers, n_heads):
    # n_layers != n_heads, both ways round, so a plot that confuses the layer and head axes
    # shows up as the wrong panel count, titles or data
    att = np.random.default_rng(0).random((n_layers, n_heads, 5, 5))
    fig = plot_attention(att, tmp_path / "att.png")
    assert (tmp_path / "att.png").stat().st_size > 0
    *axes, scale = fig.axes
    assert len(axes) == n_layers * n_heads
    assert scale.get_ylabel() == "attention weight" and scale.get_ylim() == (0.0, 1.0)
    for i, ax in enumerate(axes):
        layer, head = divmod(i, n_heads)
        assert ax.get_title() == f"layer {layer}, head {head}"
        assert np.array_equal(ax.get_images()[0].get_array(), att[layer, head])
        assert ax.get_xlabel() == "key position" and ax.get_ylabel() == "query position"
    with pytest.raises(ValueError, match="n_layers, n_heads, T, T"):
        plot_attention(att[0], tmp_path / "bad.png")


def test_loss_plot_is_written(tmp_path):
    metrics = [{"step": s, "train_loss": 4.0 / s, "lr": 1e-3} for s in range(1, 20)]
    metrics[-1]["val_loss"] = 0.5
    plot_loss(metrics, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_probe_curve_has_its_own_axis(tmp_path):
    """The repeated probe (about ln(vocab_size) nats at first) is drawn on a right-hand axis,
    so the train and validation curves (about 1 to 4 nats) keep the left one to themselves."""
    metrics = [{"step": s, "train_loss": 4.0 / s} for s in range(1, 20)]
    for m in metrics[::6]:
        m.update(val_loss=3.0 / m["step"], probe_second_half_loss=8.0 - m["step"] / 10)
    left, right = plot_loss(metrics, tmp_path / "loss.png").axes
    assert left.get_ylim()[1] < 5.0 < right.get_ylim()[0]  # neither range holds the other
    assert [line.get_label() for line in right.get_lines()] == ["repeated probe, 2nd half (right)"]
    plain = [{"step": s, "train_loss": 4.0 / s} for s in range(1, 5)]
    assert len(plot_loss(plain, tmp_path / "no-probe.png").axes) == 1


def test_the_plotter_draws_the_same_files_in_a_child_process(tmp_path):
    from decoderlm.lens.plots import Plotter

    att = np.random.default_rng(1).random((2, 2, 6, 6)).astype(np.float32)
    metrics = [{"step": s, "train_loss": 4.0 / s, "val_loss": 3.0 / s} for s in range(1, 6)]
    plot_loss(metrics, tmp_path / "loss.png")
    plot_attention(att, tmp_path / "att.png", title="a $ b")
    plotter = Plotter()
    with pytest.raises(ValueError, match="n_layers, n_heads, T, T"):
        plotter.draw(metrics, tmp_path / "l.png", att[0], tmp_path / "a.png")
    plotter.draw(metrics, tmp_path / "l2.png", att, tmp_path / "a2.png", title="a $ b")
    plotter.wait()
    plotter.close()
    assert (tmp_path / "l2.png").read_bytes() == (tmp_path / "loss.png").read_bytes()
    assert (tmp_path / "a2.png").read_bytes() == (tmp_path / "att.png").read_bytes()
    failing = Plotter()
    failing.draw(metrics, tmp_path / "no" / "l.png", att, tmp_path / "a3.png")
    with pytest.raises(RuntimeError, match="drawing the plots failed: .*No such file"):
        failing.wait()
    unused = Plotter()
    unused.close()  # ended without drawing
    assert unused.process.returncode is not None and not (tmp_path / "a3.png").exists()
    crashed = Plotter()
    crashed.process.kill()
    crashed.process.wait()
    with pytest.raises(RuntimeError, match="drawing the plots failed"):
        crashed.draw(metrics, tmp_path / "l4.png", att, tmp_path / "a4.png")
