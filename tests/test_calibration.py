"""The machine's own peak against the estimator (multigpu.estimator.accuracy.machine_calibration):
the fit against a line it must recover, the committed records, and a run it was not fitted to."""

import copy
import json

import pytest

from multigpu import records
from multigpu.config import RunConfig
from multigpu.estimator.accuracy import (
    CALIBRATED_BY,
    MACHINE_TOLERANCE,
    machine_calibration,
    machine_peak,
    machine_rows,
    setup_of,
)
from multigpu.estimator.peak import estimate, predict_largest_batch, saved_activations
from multigpu.estimator.question import Setup

GIB = 2**30


pytestmark = pytest.mark.usefixtures("committed_records")  # the committed records only (conftest)


def _committed() -> list[dict]:
    tag = next((t for t in records.machines_with(CALIBRATED_BY) if t.startswith("cpu-")), None)
    if tag is None:
        pytest.skip(f"no {CALIBRATED_BY} records of a CPU are committed")
    return records.load(CALIBRATED_BY, tag)


def test_the_fit_recovers_a_known_line(tmp_path, monkeypatch):
    # the committed runs, their machine peaks replaced by an exact line: the estimate, 0.75 bytes
    # per byte of saved activations and 300 MiB beyond it
    per_activation, fixed = 0.75, 300 * 2**20
    made = copy.deepcopy(_committed())
    for record in made:
        est = estimate(setup_of(record), record["config"]["global_batch_size"])
        record["process_peak_by_rank"][0]["peak_bytes"] = round(
            est.per_rank_bytes["total"] + per_activation * saved_activations(est) + fixed)
    folder = tmp_path / "cpu-test"
    folder.mkdir()
    (folder / f"{CALIBRATED_BY}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in made))
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    fit = machine_calibration("cpu")
    assert fit.runs == len(made) and fit.per_activation == pytest.approx(per_activation, rel=1e-6)
    assert fit.fixed == pytest.approx(fixed, rel=1e-4) and fit.worst_miss < 1e-6
    assert "cpu-test" in fit.source
    assert machine_calibration("cuda") is None  # no GPU's records: nothing to calibrate with


def test_the_committed_records_fit_within_fifteen_percent():
    runs = _committed()
    assert {r["config"]["model"].split("-")[0] for r in runs} >= {"gpt2", "t5"}
    for family in ("gpt", "t5"):
        fit = machine_calibration("cpu", family)
        assert fit is not None and fit.family == family and fit.worst_miss <= MACHINE_TOLERANCE, fit
    for row in machine_rows("cpu"):  # the machine holds more than the tensors it counts
        assert row["machine_peak"] > row["tracker"] * 0.95


def test_a_calibrated_answer_is_within_fifteen_percent_of_a_run_it_was_not_fitted_to():
    """T5 (as released, dropout on) at a batch and length no calibration run has: the
    estimate, through the line, against the resident set's peak the run measured."""
    from multigpu.launch import launch

    fit = machine_calibration("cpu", "t5")
    if fit is None:
        pytest.skip(f"no {CALIBRATED_BY} records of a CPU are committed")
    cfg = RunConfig(model="t5-small", global_batch_size=3, seq_len=128, steps=3, optimizer="sgd-momentum",
                    dataset="dummy")
    record = launch(cfg, progress=False)
    measured = machine_peak(record)
    if measured is None:
        pytest.skip("this machine cannot reset the resident set's high-water mark (/proc/self/clear_refs)")
    estimated = estimate(setup_of(record), cfg.global_batch_size)
    assert abs(fit.machine_bytes(estimated) - measured) <= MACHINE_TOLERANCE * measured, (estimated, measured, fit)


def test_a_calibration_can_only_lower_the_largest_batch():
    fit = machine_calibration("cpu", "gpt")
    if fit is None:
        pytest.skip(f"no {CALIBRATED_BY} records of a CPU are committed")
    setup = Setup("gpt2", "single", 1, seq_len=256, optimizer="adamw")
    raw, calibrated = predict_largest_batch(setup, 8 * GIB), predict_largest_batch(setup, 8 * GIB, fit)
    assert calibrated.global_batch <= raw.global_batch
    assert fit.machine_bytes(calibrated) <= 8 * GIB
    assert fit.machine_bytes(estimate(setup, calibrated.global_batch + 1)) > 8 * GIB


def test_the_command_line_says_which_calibration_it_applied():
    from test_cli import in_process, only_json_line

    fit = machine_calibration("cpu", "t5")
    if fit is None:
        pytest.skip(f"no {CALIBRATED_BY} records of a CPU are committed")
    args = ("estimate", "--model", "t5-small", "--strategy", "single", "--seq-len", "64", "--optimizer",
            "sgd-momentum", "--gpu-memory", "4GiB", "--max-batch")
    calibrated, raw = (only_json_line(in_process(*args, *extra, "--json").stdout)
                       for extra in ((), ("--uncalibrated",)))
    assert calibrated["calibration"] == fit.describe() and calibrated["machine_bytes"] <= 4 * GIB
    assert calibrated["max_batch_size"] < raw["max_batch_size"]
    text = in_process(*args).stdout
    assert "the machine's own peak, calibrated" in text and "T5 runs of machine_peak" in text
    # a GPU's: from the GPU records where some are committed, else it says there are none
    gpu = in_process("estimate", "--model", "t5-small", "--gpu", "v100-32gb", "--batch-size", "2").stdout
    cuda = machine_calibration("cuda", "t5")
    assert ("calibrated: " in gpu and cuda.describe() in gpu) if cuda else "no cuda machine's own peak" in gpu


def test_on_a_gpu_the_estimate_is_within_a_few_percent_of_what_the_allocator_held():
    """The committed GPU runs (machine_peak on CUDA): the estimate of every run, GPT-2 sizes and
    T5 in fp32 and under bf16 autocast, against the caching allocator's allocated peak; and the
    calibration fitted to them changes it by little."""
    rows = machine_rows("cuda")
    if not rows:
        pytest.skip(f"no {CALIBRATED_BY} records of a CUDA GPU are committed")
    assert {r["family"] for r in rows} == {"gpt", "t5"}
    for row in rows:
        assert abs(row["estimated"] / row["machine_peak"] - 1) <= 0.05, row
    for family in ("gpt", "t5"):
        assert machine_calibration("cuda", family).worst_miss <= 0.05


@pytest.mark.parametrize("args, says", [
    (["--model", "gpt-small", "--attention", "eager"], "scaled_dot_product_attention only"),
    (["--model", "t5-small", "--gpu", "v100-32gb", "--device", "cpu"], "drop one of them"),
])
def test_the_device_and_attention_options_are_checked(args, says):
    from test_cli import in_process

    result = in_process("estimate", *args, "--batch-size", "2")
    assert result.returncode != 0 and says in result.stderr, result.stderr
