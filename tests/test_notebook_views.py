"""What a reader sees in a notebook besides the cells' own output: a training run drawn live as
its steps arrive (progress.LiveRun, fed by the launcher from rank 0's progress lines), and under
every figure its exact values (plots.figure_values, shown by a hook after each cell that a chapter
installs with plots.show_values_in_notebooks())."""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from multigpu import plots  # noqa: E402
from multigpu.memory import ProcessPeaks  # noqa: E402


def test_figure_values_reads_back_bars_lines_and_levels():
    per_rank = {"ddp": {"params": 2**30, "grads": 2**29, "optimizer": 0, "activations": 3 * 2**30, "other": 7},
                "fsdp": {"params": 2**28, "grads": 2**27, "optimizer": 2**29, "activations": 3 * 2**30, "other": 0}}
    fig = plots.estimate_bars(per_rank, memory_bytes=4 * 2**30)
    [(title, header, rows)] = plots.figure_values(fig)
    assert header == ["series", "at", "GiB per GPU"]
    assert ["params", "ddp", "1"] in rows and ["grads", "fsdp", "0.125"] in rows
    assert ["other", "ddp", f"{7 / 2**30:,.6g}"] in rows
    assert ["device memory", "(a level)", "4"] in rows
    html = plots.figure_values_html(fig)
    assert html.startswith("<details") and "<th>at</th><th>params</th>" in html  # one column per category
    plt.close(fig)

    fig, ax = plt.subplots()
    ax.plot([1, 2, 4], [0.5, 0.25, 0.125], label="$2\\Psi$ measured")
    ax.plot([1, 2], [9, 9])  # not in the legend, but the axes' data: a column named by the axis
    ax.axhline(3)  # a level outside the legend: a decoration
    ax.set_xlabel("processes")
    ax.set_ylabel("MiB")
    [(_, header, rows)] = plots.figure_values(fig)
    assert header == ["series", "processes", "MiB"]
    assert rows == [["2Ψ measured", "1", "0.5"], ["2Ψ measured", "2", "0.25"], ["2Ψ measured", "4", "0.125"],
                    ["", "1", "9"], ["", "2", "9"]]
    html = plots.figure_values_html(fig)
    assert "<th>processes</th><th>2Ψ measured</th><th>MiB</th>" in html and "$" not in html  # no raw TeX
    plt.close(fig)

    fig, ax = plt.subplots()  # grouped bars beside their named tick
    ax.bar([-0.2, 0.8], [1, 2], width=0.4, label="measured")
    ax.bar([0.2, 1.2], [3, 4], width=0.4, label="rule")
    ax.set_xticks([0, 1], ["all-reduce", "all-gather"])
    [(_, _, rows)] = plots.figure_values(fig)
    assert rows == [["measured", "all-reduce", "1"], ["measured", "all-gather", "2"], ["rule", "all-reduce", "3"],
                    ["rule", "all-gather", "4"]]
    plt.close(fig)
    fig, _ = plt.subplots()
    assert plots.figure_values_html(fig) == ""  # nothing drawn, no table
    plt.close(fig)


def test_a_steps_peak_is_the_machines_reading_reset_per_step():
    peaks = ProcessPeaks(torch.device("cpu"))
    peaks.start_step()
    block = bytearray(256 * 2**20)
    for i in range(0, len(block), 4096):  # touched: resident
        block[i] = 1
    peaks.end_step()
    del block  # a block this large is mapped apart, so it goes back to the system
    peaks.start_step()
    peaks.end_step()
    report = peaks.report()
    if report["instrument"] is None:
        pytest.skip("no /proc/self/status and clear_refs on this system")
    first, second = report["peak_bytes_by_step"]
    assert first >= 250 * 2**20 and second < first - 200 * 2**20  # the mark was reset between the steps
    assert report["peak_bytes"] == first and report["instrument"] == "resident set (VmHWM)"


NOTEBOOK = """
from multigpu import plots, progress
from multigpu.config import RunConfig
from multigpu.launch import launch

plots.show_values_in_notebooks()  # as a chapter's first cell does
calls, update = [], progress.LiveRun.update
progress.LiveRun.update = lambda self, *a: (calls.append(a), update(self, *a))[1]
record = launch(RunConfig(strategy="ddp", world_size=2, steps=3, model="gpt-tiny"), progress=True)
print("CALLS", json.dumps(calls), "RECORD", json.dumps([record["loss"], record["step_times_s_by_rank"][0]]))
%%
plots.estimate_bars({"ddp": {"params": 2**30, "grads": 0, "optimizer": 0, "activations": 0, "other": 0}});
"""


def test_a_run_in_a_notebook_is_drawn_live_and_each_figure_shows_its_values(tmp_path):
    """Executed in a real kernel: the run's steps reach the live figure (loss as rank 0 printed
    it, step time, peak memory), which stays in the cell once; a chapter's figure is followed by
    its table."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [nbformat.v4.new_code_cell("import json\n" + source.strip()) for source in NOTEBOOK.split("%%")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    run, figure = (cell.outputs for cell in notebook.cells)
    text = "".join(o.get("text", "") for o in run if o.output_type == "stream")
    assert "@@multigpu-progress" not in text
    calls = json.loads(text.split("CALLS ")[1].split(" RECORD")[0])
    losses, step_times = json.loads(text.split("RECORD ")[1])
    assert [c[0] for c in calls] == [1, 2, 3]
    assert [round(c[2], 6) for c in calls] == [round(t, 6) for t in step_times]  # rank 0's step times
    # rank 0's loss, on its half of the batch: near the run's (the mean over ranks), not equal
    assert all(math.isclose(c[1], loss, rel_tol=0.02) for c, loss in zip(calls, losses)), (calls, losses)
    assert calls[0][3] > 0 and all(c[3] >= 0 for c in calls)  # each step's peak, as /proc counts it
    images = [o for o in run if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1, "the live figure is shown once, in its last state"
    kinds = [next(k for k in ("image/png", "text/html") if k in o.get("data", {})) for o in figure
             if o.output_type == "display_data"]
    assert kinds == ["image/png", "text/html"] and "figure-values" in figure[-1].data["text/html"]
