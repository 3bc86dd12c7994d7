"""Result records: JSON-lines files under results/<machine-tag>/<experiment>.jsonl.
References: the records written (round trip), the line numbers of the file we wrote,
and the documented order of machines (GPUs before CPUs, more devices first)."""

from __future__ import annotations

import json
import warnings

import pytest

from multigpu import records
from multigpu.records import CorruptRecordWarning, read_records, write_records

RECORDS = [
    {"name": "a", "loss": [4.5, 4.25], "config": {"strategy": "ddp", "world_size": 2}},
    {"name": "b", "nested": {"x": [1, 2, {"y": None}]}, "flag": True},
    {"name": "c", "unicode": "ø µs", "big": 2**53},
]


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setenv("MULTIGPU_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


def test_round_trip(tmp_path):
    path = tmp_path / "tag" / "exp.jsonl"  # the folder does not exist yet
    write_records(path, RECORDS)
    assert read_records(path) == RECORDS
    assert len(path.read_text().splitlines()) == len(RECORDS)  # one line per record


def test_rewrite_replaces_the_file(tmp_path):
    path = tmp_path / "exp.jsonl"
    write_records(path, RECORDS)
    write_records(path, RECORDS[:1])
    assert read_records(path) == RECORDS[:1]


def test_no_tmp_file_left_behind(tmp_path):
    path = tmp_path / "exp.jsonl"
    write_records(path, RECORDS)
    assert [p.name for p in tmp_path.iterdir()] == ["exp.jsonl"]


def test_failed_write_keeps_the_old_file(tmp_path):
    """All or nothing: a record that cannot be written leaves the previous file intact."""
    path = tmp_path / "exp.jsonl"
    write_records(path, RECORDS)
    with pytest.raises(TypeError):
        write_records(path, [RECORDS[0], {"not json": object()}])
    assert read_records(path) == RECORDS


def test_failed_write_leaves_no_tmp_file(tmp_path):
    path = tmp_path / "exp.jsonl"
    write_records(path, RECORDS)
    with pytest.raises(TypeError):
        write_records(path, [RECORDS[0], {"not json": object()}])
    assert [p.name for p in tmp_path.iterdir()] == ["exp.jsonl"]


@pytest.mark.parametrize("bad_line", ['{"name": "trunc', "not json at all", "[1, 2, 3]", "42"])
def test_corrupt_line_is_skipped_with_a_warning(tmp_path, bad_line):
    path = tmp_path / "exp.jsonl"
    lines = [json.dumps(r) for r in RECORDS]
    lines.insert(2, bad_line)  # file line 3, between good records
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is not an error
    with pytest.warns(CorruptRecordWarning) as caught:
        got = read_records(path)
    assert got == RECORDS
    assert len(caught) == 1
    message = str(caught[0].message)
    assert str(path) in message
    assert "line 3 " in message


def test_clean_file_gives_no_warning(tmp_path):
    path = tmp_path / "exp.jsonl"
    write_records(path, RECORDS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_records(path)


def test_machines_with_orders_gpus_first_then_by_device_count(results_dir):
    tags = ["cpu-2core-gloo", "2xH100-nccl", "cpu-16core-gloo", "8xA100-nccl", "16xH100-nccl", "1xL4-nccl"]
    for tag in tags:
        write_records(results_dir / tag / "scaling.jsonl", [{"tag": tag}])
    write_records(results_dir / "4xH200-nccl" / "other.jsonl", [{}])  # another experiment
    assert records.machines_with("scaling") == [
        "16xH100-nccl", "8xA100-nccl", "2xH100-nccl", "1xL4-nccl", "cpu-16core-gloo", "cpu-2core-gloo"]
    # load() without a tag reads the richest machine's records
    assert records.load("scaling") == [{"tag": "16xH100-nccl"}]
    assert records.load("scaling", tag="cpu-2core-gloo") == [{"tag": "cpu-2core-gloo"}]


def test_load_with_needs_reads_the_richest_machine_that_holds_them(results_dir):
    """A machine whose `make figures` stopped early holds fewer runs: a figure that needs two
    falls back to the next machine that has them, and says so when none has."""
    write_records(results_dir / "8xH100-nccl" / "runs.jsonl", [{"n": 1}])
    write_records(results_dir / "2xH100-nccl" / "runs.jsonl", [{"n": 1}, {"n": 2}])
    write_records(results_dir / "cpu-2core-gloo" / "runs.jsonl", [{"n": 1}, {"n": 2}, {"n": 3}])
    assert records.load("runs", needs=lambda runs: len(runs) >= 2) == [{"n": 1}, {"n": 2}]
    assert records.load("runs", needs=lambda runs: True) == [{"n": 1}]  # the richest, as without
    with pytest.raises(FileNotFoundError, match="hold the runs this figure needs"):
        records.load("runs", needs=lambda runs: len(runs) > 3)


def test_load_missing_experiment_says_how_to_make_it(results_dir):
    with pytest.raises(FileNotFoundError) as info:
        records.load("nonexistent")
    message = str(info.value)
    assert "'nonexistent'" in message
    assert str(results_dir) in message
    assert "python -m multigpu figures --experiments nonexistent" in message


def test_results_path_uses_this_machines_tag(results_dir):
    assert records.results_path("exp") == results_dir / records.machine_tag() / "exp.jsonl"
    assert records.results_path("exp", "cpu-2core-gloo") == results_dir / "cpu-2core-gloo" / "exp.jsonl"


def _job_records(value, tag="cpu-test"):
    return [{"value": value, "provenance": {"machine_tag": tag}}]


def _fails():
    raise RuntimeError("out of memory (pretend)")


def test_figures_never_lose_records(tmp_path, monkeypatch):
    """A failing run is reported and skipped, the other runs are recorded, the old records of
    what did not run again are kept, and the experiment says it failed; a complete run
    then leaves exactly its new records."""
    from multigpu import experiments, records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    path = records.results_path("fake", "cpu-test")
    path.parent.mkdir(parents=True)
    write_records(path, [{"value": "old a", "job": "a", "provenance": {"machine_tag": "cpu-test"}},
                         {"value": "old b", "job": "b", "provenance": {"machine_tag": "cpu-test"}}])
    jobs = [experiments.Job("a", _job_records, {"value": "new a"}), experiments.Job("b", _fails),
            experiments.Job("c", _job_records, {"value": "new c"})]
    monkeypatch.setitem(experiments.EXPERIMENTS, "fake", lambda: jobs)
    with pytest.raises(experiments.ExperimentFailed, match=r"1 of 3 run\(s\) failed: b: out of memory"):
        experiments.run_experiment("fake")
    assert sorted(r["value"] for r in read_records(path)) == ["new a", "new c", "old b"]
    jobs[1] = experiments.Job("b", _job_records, {"value": "new b"})
    experiments.run_experiment("fake")
    assert sorted(r["value"] for r in read_records(path)) == ["new a", "new b", "new c"]


def test_results_go_where_the_readme_says(tmp_path, monkeypatch):
    """MULTIGPU_RESULTS, else the checkout's results/ (the package's own, else the one the
    current folder is in), else ./results."""
    root = records.find_checkout(records.Path(records.__file__).resolve().parent)
    assert root is not None and (root / "src" / "multigpu" / "records.py").is_file()
    assert records.find_checkout(root / "book") == root
    assert records.find_checkout(tmp_path) is None
    monkeypatch.setenv("MULTIGPU_RESULTS", str(tmp_path / "mine"))
    assert records._results_dir() == (tmp_path / "mine", "MULTIGPU_RESULTS")
    monkeypatch.delenv("MULTIGPU_RESULTS")
    assert records._results_dir()[0] == root / "results"
    monkeypatch.setattr(records, "CHECKOUT", None)  # installed from a wheel, run outside any checkout
    monkeypatch.chdir(tmp_path)
    folder, why = records._results_dir()
    assert folder == tmp_path / "results" and "current folder" in why
