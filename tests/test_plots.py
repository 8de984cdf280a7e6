"""zero_core.plots: every figure renders headless, is labelled, and `save_all` / `compare --plots` write them."""

from __future__ import annotations

import io
import json

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from zero_core import memory, plots
from zero_core.cli import main
from zero_core.experiment import compare_stages
from zero_core.model import preset
from zero_core.stages import TrainConfig
from zero_core.units import GB

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED_FILES = {
    "memory_bars.png",
    "comm_bars.png",
    "memory_vs_gpus.png",
    "memory_timeline_zero0.png",
    "memory_timeline_zero1.png",
    "memory_timeline_zero2.png",
    "memory_timeline_zero3.png",
    "loss_curves.png",
}


@pytest.fixture(scope="module")
def reports():
    return compare_stages([0, 1, 2, 3], world_size=2, steps=2, config=TrainConfig(model=preset("micro")))


def png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


def assert_labelled(fig: Figure) -> None:
    ax = fig.axes[0]
    assert ax.get_title(), "a figure needs a title"
    assert ax.get_xlabel() and ax.get_ylabel(), "both axes need a label"
    assert ax.get_legend() is not None, "a figure needs a legend"


FIGURES = {
    "memory_bars": lambda reports: plots.memory_bars(reports),
    "comm_bars": lambda reports: plots.comm_bars(reports),
    "memory_vs_gpus": lambda reports: plots.memory_vs_gpus(7.5e9, gpu_memory_bytes=32 * GB),
    "memory_timeline": lambda reports: plots.memory_timeline(reports[3], ranks=(0, 1)),
    "loss_curves": lambda reports: plots.loss_curves(reports),
}


@pytest.mark.parametrize("name", FIGURES)
def test_each_figure_renders_headless_to_a_png_with_title_axis_labels_and_legend(name, reports) -> None:
    fig = FIGURES[name](reports)
    data = png_bytes(fig)
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert_labelled(fig)


def test_memory_bars_units_are_on_the_axis(reports) -> None:
    assert "(KB)" in plots.memory_bars(reports).axes[0].get_ylabel()


def test_memory_vs_gpus_draws_four_stages_and_the_gpu_memory_line_on_log_axes() -> None:
    ax = plots.memory_vs_gpus(7.5e9, gpu_counts=(1, 4, 16, 64), gpu_memory_bytes=32 * GB).axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    curves = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    assert list(curves["ZeRO-3: 16Ψ/N"]) == pytest.approx([120, 30, 7.5, 1.875])
    assert any(label.startswith("GPU memory (32 GB)") for label in curves)


def test_zero3_timeline_shows_the_gathered_layers_as_transient_spikes(reports) -> None:
    ax = plots.memory_timeline(reports[3]).axes[0]
    transients = [c for c in ax.collections if isinstance(c, PolyCollection) and "transient" in c.get_label()]
    assert transients, "ZeRO-3's gathered parameters must show in the timeline"
    totals = ax.get_lines()[0].get_ydata()
    spikes = sum(1 for i in range(1, len(totals) - 1) if totals[i - 1] < totals[i] > totals[i + 1])
    assert spikes >= 10, "one spike per gathered layer, forward and backward"


def test_zero0_timeline_shows_its_optimizer_temporaries_and_no_layer_transients(reports) -> None:
    report = reports[0]
    ax = plots.memory_timeline(report).axes[0]
    assert any("transient" in c.get_label() for c in ax.collections)
    peaks = report.peak_bytes_by_category_max
    assert peaks[memory.GATHER] == peaks[memory.GRAD_BUCKET] == 0
    assert peaks[memory.TEMPORARY] >= 6 * report.psi, "the optimizer's bf16 concatenation (2Ψ) and its fp32 copy (4Ψ)"


def test_memory_timeline_refuses_a_step_that_did_not_run(reports) -> None:
    with pytest.raises(ValueError, match="step"):
        plots.memory_timeline(reports[0], step=5)


def test_loss_curves_overlay_every_stage_with_distinct_markers(reports) -> None:
    lines = plots.loss_curves(reports).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 4


def test_save_all_writes_the_listed_pngs_into_a_new_folder(reports, tmp_path) -> None:
    folder = tmp_path / "figures" / "run"
    paths = plots.save_all(reports, folder)
    assert {path.name for path in paths} == EXPECTED_FILES
    for path in paths:
        assert path.parent == folder and path.read_bytes().startswith(PNG_SIGNATURE)


def test_compare_writes_plots_and_a_trace(tmp_path, capsys) -> None:
    folder, trace = tmp_path / "plots", tmp_path / "trace.json"
    argv = ["compare", "--world-size", "2", "--steps", "1", "--stages", "0,3", "--preset", "micro", "--no-progress"]
    assert main([*argv, "--plots", str(folder), "--trace", str(trace)]) == 0
    names = {path.name for path in folder.iterdir()}
    assert names == EXPECTED_FILES - {"memory_timeline_zero1.png", "memory_timeline_zero2.png"}
    assert {e["pid"] for e in json.loads(trace.read_text())["traceEvents"]} == {0, 3}
    assert "wrote 6 figures" in capsys.readouterr().out


def test_divergence_curves_draw_each_broken_run_on_log_axes_and_name_a_run_that_never_diverged() -> None:
    from zero_core.divergence import Divergence

    fig = plots.divergence_curves(
        {"broken": Divergence([0.0, 1e-4, 3e-4], [0.0, 1e-3, 2e-3]), "restored": Divergence([0.0] * 3, [0.0] * 3)}
    )
    assert png_bytes(fig).startswith(PNG_SIGNATURE)
    assert_labelled(fig)
    loss, master = fig.axes
    assert loss.get_yscale() == master.get_yscale() == "log"
    assert list(master.lines[0].get_xdata()) == [1, 2] and len(master.lines[1].get_xdata()) == 0
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["broken", "restored (0.0 at every step)"]
