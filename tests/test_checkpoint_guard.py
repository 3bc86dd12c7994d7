"""What is checked before a checkpoint is loaded or saved into, and how an asynchronous save hands its state
to DCP's writer: a checkpoint damaged at its size (a weight's bytes, the zip structure, DCP's index) is refused
by name before any process starts; a folder no save could write is refused before the training it would lose;
a config.json is known by its content; a run resumed under another layout records the saved run's losses; a
staged DTensor is its pinned host buffer with the original's spec, and the background writer makes no CUDA
call for host tensors."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from multigpu import checkpoint, checkpoint_guard
from multigpu.config import ConfigError, RunConfig
from multigpu.launch import launch

BASE = dict(model="gpt-tiny", global_batch_size=8, dataset_size=32, optimizer="adamw", lr=0.01, track_memory=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """ddp on 2 ranks, 2 steps, saving after each: the step-2 checkpoint."""
    root = tmp_path_factory.mktemp("guard")
    cfg = RunConfig(strategy="ddp", world_size=2, steps=2, checkpoint_dir=str(root / "ck"), checkpoint_every=1, **BASE)
    launch(cfg, progress=False)
    return checkpoint.step_dir(cfg.checkpoint_dir, 2)


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved.parent, tmp_path / "ck")
    return tmp_path / "ck" / saved.name


def _resume(step: Path, **over) -> RunConfig:
    return RunConfig(strategy="ddp", world_size=2, steps=3, resume=str(step), **{**BASE, **over})


def _overwrite(file: Path, offset: int, data: bytes) -> None:
    """Same-size damage: `data` written over the file's bytes at `offset`."""
    raw = bytearray(file.read_bytes())
    raw[offset:offset + len(data)] = data
    file.write_bytes(bytes(raw))


def test_meta_names_the_model_and_checksums_every_file(saved):
    meta = checkpoint.read_meta(saved)
    assert meta["model_identity"] == "gpt-tiny"
    assert meta["checksums"].keys() == meta["files"].keys() and ".metadata" in meta["files"]
    assert all(meta["checksums"][name] == checkpoint.checksum(saved / name) for name in meta["files"])


def _a_weights_offset(step: Path) -> tuple[Path, int]:
    """Where the bytes of a weight lie in the rank files (found by its values, as the whole tensor reads them)."""
    weight = checkpoint.whole(step)[0]["model.blocks.0.attn.qkv.weight"].contiguous().numpy().tobytes()
    for file in sorted(step.glob("__*_0.distcp")):
        at = file.read_bytes().find(weight[:256])
        if at >= 0:
            return file, at + 64
    raise AssertionError("the weight's bytes were not found in any rank's file")


@pytest.mark.parametrize("where", ["weight", "zip structure", ".metadata"])
def test_same_size_damage_is_refused_before_any_process_starts(saved, tmp_path, run_dirs, where):
    step = _copy(saved, tmp_path)
    if where == "weight":  # c05: loaded silently and trained on, before checksums
        file, at = _a_weights_offset(step)
        _overwrite(file, at, bytes(16))
    elif where == "zip structure":  # c04: PytorchStreamReader's traceback
        file = step / "__1_0.distcp"
        _overwrite(file, 0, torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                          dtype=torch.uint8).numpy().tobytes())
    else:  # c07: an unpickling traceback
        file = step / ".metadata"
        _overwrite(file, 0, bytes(file.stat().st_size))
    with pytest.raises(checkpoint.CheckpointError, match=rf"{step} is damaged: {file.name} \(has the size written "
                       r"but not the bytes: checksum differs\)\. Nothing was loaded; resume from an earlier step-N"):
        launch(_resume(step), progress=False)
    assert not list(run_dirs.glob("multigpu-run-*"))  # refused before the run's folder was made


def test_a_checkpoint_saved_before_checksums_loads_and_its_damage_is_still_named(saved, tmp_path, run_dirs):
    """Without checksums in meta.json: sizes are checked as before, a damaged index before any process starts,
    and a rank file damaged at its size by the workers' DCP read, as the same one-line "damaged" error."""
    step = _copy(saved, tmp_path)
    meta = json.loads((step / checkpoint.META).read_text())
    meta.pop("checksums")
    (step / checkpoint.META).write_text(json.dumps(meta))
    checkpoint_guard.before_launch(_resume(step))  # whole: accepted
    index = (step / ".metadata").read_bytes()
    _overwrite(step / ".metadata", 0, bytes(len(index)))
    with pytest.raises(checkpoint.CheckpointError, match=r"damaged: \.metadata cannot be read \(UnpicklingError"):
        checkpoint_guard.before_launch(_resume(step))
    (step / ".metadata").write_bytes(index)
    _overwrite(step / "__1_0.distcp", 0, bytes(4096))
    with pytest.raises(checkpoint.CheckpointError, match=r"is damaged: DCP could not read it") as refused:
        launch(_resume(step), progress=False)
    assert "\n" not in str(refused.value) and "traceback" not in str(refused.value)


def test_the_resumed_folder_is_said_to_be_missing_and_a_skipped_step_is_named(saved, tmp_path, capsys):
    with pytest.raises(checkpoint.CheckpointError, match=f"{tmp_path / 'nowhere'} does not exist"):
        checkpoint.resolve(tmp_path / "nowhere")
    step = _copy(saved, tmp_path)
    (step / checkpoint.META).unlink()  # c19: the newest save, cut short
    checkpoint_guard.before_launch(_resume(step.parent))
    assert f"resuming from {step.parent / 'step-00000001'}; passed over step-00000002 (newer, but without " \
           "meta.json" in capsys.readouterr().err


@pytest.mark.parametrize("under", ["a file", "proc"])
def test_a_checkpoint_dir_no_save_could_write_is_refused_before_launch(tmp_path, run_dirs, under):
    if under == "a file":  # c10c
        (tmp_path / "t.sh").write_text("echo\n")
        folder, reason = tmp_path / "t.sh" / "ck", "Not a directory"
    else:  # a folder the kernel makes no files in
        folder, reason = Path("/proc/self/ck"), ""
    cfg = RunConfig(strategy="ddp", world_size=2, steps=2, checkpoint_dir=str(folder), **BASE)
    with pytest.raises(ConfigError, match=rf"checkpoint_dir {folder} cannot be written \({reason}.*give "
                                          "--checkpoint-dir a folder this user can write"):
        launch(cfg, progress=False)
    assert not list(run_dirs.glob("multigpu-run-*"))


def test_a_read_only_checkpoint_dir_is_refused(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="cannot be written .Permission denied"):
        checkpoint_guard.check_writable(tmp_path / "ro" / "ck")
    checkpoint_guard.check_writable(tmp_path / "rw" / "ck")  # made, written, left empty
    assert list((tmp_path / "rw" / "ck").iterdir()) == []


def test_the_cli_says_an_unwritable_checkpoint_dir_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "t.sh").write_text("echo\n")
    done = subprocess.run([sys.executable, "-m", "multigpu", "run", "--strategy", "ddp", "--world-size", "2",
                           "--steps", "2", "--checkpoint-dir", str(tmp_path / "t.sh" / "ck")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "cannot be written" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr


def _meta(model: str, cfg: RunConfig, identity: bool = True) -> dict:
    same = {k: getattr(cfg, k) for k in checkpoint.SAME_RUN}
    return {"same_run": {**same, "model": model}, "steps_done": 1, "names": "canonical",
            "config": {"strategy": cfg.strategy}, "grid": cfg.grid.as_dict(),
            **({"model_identity": checkpoint.model_identity(model)} if identity else {})}


def test_a_config_json_is_known_by_its_content(tmp_path, monkeypatch):
    """c09b: the same file by another path continues; c09: the file edited at the same path is refused with why."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    settings = {"model_type": "gpt2", "vocab_size": 128, "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32}
    (tmp_path / "cfg" / "v.json").write_text(json.dumps(settings))
    meta = _meta("cfg/v.json", RunConfig(model="cfg/v.json", steps=3))
    assert checkpoint.compatibility_problems(meta, RunConfig(model=str(tmp_path / "cfg" / "v.json"), steps=3)) == []
    (tmp_path / "cfg" / "w.json").write_text(json.dumps(settings, indent=4))  # another file, the same settings
    assert checkpoint.compatibility_problems(meta, RunConfig(model="cfg/w.json", steps=3)) == []
    (tmp_path / "cfg" / "v.json").write_text(json.dumps({**settings, "vocab_size": 256}))
    problem, = checkpoint.compatibility_problems(meta, RunConfig(model="cfg/v.json", steps=3))
    assert "model 'cfg/v.json' with other settings: that file was edited after the save" in problem
    problem, = checkpoint.compatibility_problems(meta, RunConfig(model="gpt-tiny", steps=3))
    assert "model 'cfg/v.json' (this run: 'gpt-tiny')" in problem
    old = _meta("cfg/v.json", RunConfig(model="cfg/v.json", steps=3), identity=False)  # saved before identities
    assert checkpoint.compatibility_problems(old, RunConfig(model="cfg/v.json", steps=3)) == []


def test_a_resume_under_another_layout_records_the_saved_runs_losses(tmp_path):
    """Problem 7: zero3 on 4 ranks saved at step 3 (a local layout), resumed by fsdp on 2 through its canonical
    copy, made by the launcher: the record's first three losses are the saved run's, over all its ranks, and
    `resumed.losses` holds those three only (not the list training went on appending to)."""
    common = dict(BASE, dataset_size=48, steps=3)
    saved_run = launch(RunConfig(strategy="zero3", world_size=4, checkpoint_dir=str(tmp_path / "ck"), **common),
                       progress=False)
    step = checkpoint.step_dir(tmp_path / "ck", 3)
    resumed = launch(RunConfig(strategy="fsdp", world_size=2, resume=str(step), **{**common, "steps": 6}),
                     progress=False)
    assert step.with_name(step.name + ".canonical").is_dir()
    assert resumed["loss"][:3] == saved_run["loss"]
    assert resumed["checkpoint"]["resumed"]["losses"] == saved_run["loss"]
    assert len(resumed["loss"]) == 6


# -- the asynchronous save's staging and writer (one process, gloo) ------------------------------------------


def _checkpointer(tmp_path: Path) -> checkpoint.Checkpointer:
    cfg = RunConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_async=True, steps=1)
    rt = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    return checkpoint.Checkpointer(cfg, rt, types.SimpleNamespace(checkpoint_names="canonical", scaler=None))


def _sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return {"model": {"w": distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]), "b": torch.ones(3)}}


def test_a_staged_dtensor_is_its_pinned_host_buffer(one_process_group, tmp_path):
    """G12: DTensor.from_local would move the buffer back to the mesh's device (on GPUs a second copy of the
    state); the staged DTensor holds the checkpointer's buffer itself, with the original's spec, made once."""
    ck, state = _checkpointer(tmp_path), _sharded()
    staged = ck._staged(state)["model"]["w"]
    assert staged._local_tensor is ck.buffers["model.w"]
    assert staged._spec == state["model"]["w"]._spec
    assert torch.equal(staged.full_tensor(), state["model"]["w"].full_tensor())
    state["model"]["w"].to_local().add_(1)  # training goes on: the next save copies into the same buffer
    again = ck._staged(state)["model"]["w"]
    assert again is staged and torch.equal(again.to_local(), state["model"]["w"].to_local())


def _loaders_made(monkeypatch) -> list[str]:
    """Which of DCP's tensor loaders its writer makes, as if this machine had CUDA: the overlapping one takes
    the writer thread's current CUDA stream (GPU 0 in a new thread), the serial one makes no CUDA call."""
    from torch.distributed.checkpoint import filesystem

    made = []

    def overlapping(resolve_fun, **_):
        made.append("overlapping")
        return filesystem._SerialCpuLoader(resolve_fun)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(filesystem, "_OverlappingCpuLoader", overlapping)
    return made


def test_the_background_writer_makes_no_cuda_call(one_process_group, tmp_path, monkeypatch):
    """G13: an asynchronous save writes host tensors with DCP's serial loader, and so does the canonical copy;
    DCP's default writer would take the overlapping one (the control)."""
    import torch.distributed.checkpoint as dcp

    from multigpu import reshard

    ck, state = _checkpointer(tmp_path), _sharded()
    monkeypatch.setattr(checkpoint, "checkpoint_state", lambda par, rank: (state, None))
    made = _loaders_made(monkeypatch)
    ck.save(1, [4.0])
    ck.close()
    assert made == []
    step = checkpoint.step_dir(tmp_path / "ck", 1)
    checkpoint.verify(step, checkpoint.read_meta(step))
    meta = checkpoint.read_meta(step)
    reshard._write_canonical(tmp_path / "copy", meta, {"w": torch.ones(2)}, {}, {"steps_done": torch.tensor(1)}, step)
    assert made == []
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "default")  # the control
    assert made == ["overlapping"]
