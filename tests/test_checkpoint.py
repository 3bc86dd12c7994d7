"""Checkpoints: a run stopped and resumed ends bit for bit where the unbroken run ends, for every family
of strategies; a checkpoint loads under another layout with every tensor unchanged; a save cut short at
any stage leaves the previous checkpoint whole; a killed rank restarted by torchrun finishes like the
unbroken run; a damaged or foreign checkpoint is refused by name before anything is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multigpu import checkpoint
from multigpu.config import ConfigError, RunConfig
from multigpu.data import TokenDataset, batches, make_loader
from multigpu.launch import LaunchError, launch, launch_series

BASE = dict(model="gpt-tiny", global_batch_size=8, dataset_size=32, optimizer="adamw", lr=0.01, steps=3,
            track_memory=False)
# (strategy, processes, overrides): every family, at 1, 2 and 4 processes
RESUMED = [
    ("single", 1, {}),
    ("dp", 2, {}),
    ("ddp", 2, {}),
    ("zero2", 2, {}),
    ("zero3", 2, {}),
    ("zero1-torch", 2, {}),
    ("fsdp", 2, {}),
    ("tp", 2, {}),
    ("tp-scratch", 2, {}),
    ("pp-1f1b-scratch", 2, {"model": "gpt-mini", "grad_accum_steps": 2}),
    ("cp-scratch", 2, {}),
    ("ep-scratch", 2, {"model": "gpt-moe-tiny"}),
    ("fsdp", 4, {"tp": 2}),
    ("ddp-scratch", 4, {"tp": 2}),
    ("pp-1f1b", 4, {"model": "gpt-mini", "dp": 2, "grad_accum_steps": 2}),
    ("fsdp", 4, {"model": "gpt-moe-tiny", "ep": 2}),
    ("zero1", 4, {}),
    ("deepspeed-zero2", 2, {}),
    ("deepspeed-zero3", 2, {}),
    ("deepspeed-moe", 2, {"model": "gpt-moe-tiny"}),  # the engine saves each ep rank's experts in their own files
    # saved in the background: the state copied into reused host buffers, a DTensor's pieces with their placement
    ("single", 1, {"checkpoint_async": True}),
    ("fsdp", 2, {"checkpoint_async": True}),
]


def _series(cfgs: list[RunConfig], params: Path) -> list[tuple[dict, dict]]:
    """(record, trained weights) of each config, every group of the same process count in one series."""
    out = {}
    for processes in sorted({c.processes for c in cfgs}):
        idx = [i for i, c in enumerate(cfgs) if c.processes == processes]
        folder = params / f"p{processes}"
        folder.mkdir(parents=True)
        records = launch_series([cfgs[i] for i in idx], params_dir=folder)
        out.update({i: (r, torch.load(folder / f"run{j}.pt")) for j, (i, r) in enumerate(zip(idx, records))})
    return [out[i] for i in range(len(cfgs))]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each case trained 3 steps unbroken, saving after steps 2 and 3; then again from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("resume")
    unbroken = [RunConfig(strategy=s, world_size=n, checkpoint_dir=str(root / f"case{i}"), checkpoint_every=2,
                          **{**BASE, **o}) for i, (s, n, o) in enumerate(RESUMED)]
    first = _series(unbroken, root / "first")
    again = [c.replace(checkpoint_dir=None, checkpoint_every=None, checkpoint_async=False,
                       resume=str(checkpoint.step_dir(c.checkpoint_dir, 2))) for c in unbroken]
    return first, _series(again, root / "again"), [checkpoint.step_dir(c.checkpoint_dir, 2) for c in unbroken]


@pytest.mark.parametrize("case", range(len(RESUMED)), ids=[f"{s}-{n}{''.join(f'-{k}{v}' for k, v in o.items())}"
                                                           for s, n, o in RESUMED])
def test_resumed_run_ends_bit_for_bit_like_the_unbroken_one(resumed, case):
    (record, weights), (resumed_record, resumed_weights) = resumed[0][case], resumed[1][case]
    assert resumed_record["checkpoint"]["resumed"]["steps_done"] == 2
    assert resumed_record["loss"] == record["loss"]  # the first two from the checkpoint, the third trained again
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights), \
        [k for k in weights if not torch.equal(weights[k], resumed_weights[k])]
    saves = record["checkpoint"]["saves"][0]
    assert [s["steps_done"] for s in saves] == [2, 3]
    assert all(s["bytes_total"] > 0 and s["total_s"] >= s["blocking_s"] > 0 for s in saves)


def test_a_checkpoint_moves_between_layouts_unchanged(tmp_path):
    """FSDP on 4 ranks -> FSDP x TP (2 x 2) -> a pipeline of 2 -> one device: each run loads the last one's
    checkpoint and saves it again under its own layout (as many steps as done: none trained)."""
    chain = [("fsdp", 4, {}), ("fsdp", 4, {"tp": 2}), ("pp-gpipe", 2, {}), ("single", 1, {})]
    folders = []
    for i, (strategy, n, over) in enumerate(chain):
        cfg = RunConfig(strategy=strategy, world_size=n, checkpoint_dir=str(tmp_path / str(i)),
                        resume=str(folders[-1]) if folders else None, **{**BASE, "steps": 2, **over})
        record = launch(cfg, progress=False)
        folders.append(checkpoint.step_dir(cfg.checkpoint_dir, 2))
        if i:
            assert record["checkpoint"]["resumed"]["saved_by"]["strategy"] == chain[i - 1][0]
    first = checkpoint.whole(folders[0])[0]
    assert any(k.endswith(".exp_avg_sq") for k in first) and "model.lm_head.weight" in first
    for folder in folders[1:]:
        again = checkpoint.whole(folder)[0]
        assert again.keys() == first.keys()
        assert [k for k in first if not torch.equal(first[k], again[k])] == []


DDP = RESUMED.index(("ddp", 2, {}))


@pytest.fixture(scope="module")
def unbroken_ddp(resumed):
    """The weights of DDP's unbroken run above (3 steps; saving changes no weight)."""
    return resumed[0][DDP][1]


@pytest.mark.parametrize("stage", checkpoint.SAVE_STAGES)
def test_a_save_cut_short_leaves_the_previous_checkpoint_whole(tmp_path, unbroken_ddp, stage):
    """Rank 1 killed in the save after step 2 at `stage`: the newest complete checkpoint is step 1 (step 2
    once renamed), and a run resumed from the folder ends like the unbroken run."""
    folder = tmp_path / "ck"
    cfg = RunConfig(strategy="ddp", world_size=2, checkpoint_dir=str(folder), checkpoint_every=1,
                    fault=f"kill@1:2:{stage}", **BASE)
    with pytest.raises(LaunchError, match="rank 1 was killed by signal SIGKILL"):
        launch(cfg, progress=False)
    newest = checkpoint.resolve(folder)
    assert newest.name == ("step-00000002" if stage == "renamed" else "step-00000001")
    if stage == "written":  # (a complete step-N resumes exactly: the tests above)
        resumed = cfg.replace(fault=None, checkpoint_dir=None, checkpoint_every=None, resume=str(folder))
        launch(resumed, params_path=tmp_path / "w.pt", progress=False)
        weights = torch.load(tmp_path / "w.pt")
        assert all(torch.equal(weights[k], unbroken_ddp[k]) for k in weights)


def test_a_killed_rank_is_restarted_from_the_last_checkpoint(tmp_path, unbroken_ddp):
    cfg = RunConfig(strategy="ddp", world_size=2, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1,
                    fault="kill@1:2", **BASE)
    record = launch(cfg, params_path=tmp_path / "w.pt", progress=False, max_restarts=1)
    assert record["restarts"] == 1 and record["checkpoint"]["resumed"]["steps_done"] == 2
    weights = torch.load(tmp_path / "w.pt")
    assert all(torch.equal(weights[k], unbroken_ddp[k]) for k in weights)


@pytest.fixture(scope="module")
def saved(resumed):
    """The checkpoint folder of DDP's unbroken run above (its newest: after the last of 3 steps)."""
    return Path(resumed[0][DDP][0]["config"]["checkpoint_dir"])


def test_a_damaged_checkpoint_is_refused_by_name(saved, tmp_path):
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    step = checkpoint.resolve(copy)
    data = step / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match=r"damaged: __1_0.distcp \(100 bytes, written with \d+\)"):
        checkpoint.read_meta(step)
    (step / "__0_0.distcp").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"__0_0.distcp \(missing"):
        RunConfig(strategy="ddp", world_size=2, resume=str(step), **{**BASE, "steps": 5}).validate()
    (step / checkpoint.META).unlink()  # no longer a complete checkpoint: the one before it is the newest
    assert checkpoint.resolve(copy) == checkpoint.step_dir(copy, 2)
    (checkpoint.step_dir(copy, 2) / checkpoint.META).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint in .*lack meta.json"):
        checkpoint.resolve(copy)


@pytest.mark.parametrize("change, message", [
    (dict(model="gpt-mini"), "saved by a run with model 'gpt-tiny'"),
    (dict(dataset_size=None, steps=5), "give both runs the same --dataset-size"),
    (dict(steps=3), "nothing to train"),
    (dict(strategy="fsdp", world_size=4), None),  # canonical names: another layout loads them
])
def test_a_foreign_checkpoint_is_refused_before_launch(saved, change, message):
    cfg = RunConfig(**{"strategy": "ddp", "world_size": 2, "resume": str(saved), **BASE, "steps": 5, **change})
    if message is None:
        cfg.validate()
    else:
        with pytest.raises(ConfigError, match=message):
            cfg.validate()


def test_checkpoint_options_are_checked(saved, tmp_path):
    with pytest.raises(ConfigError, match="checkpoint_every needs a checkpoint_dir"):
        RunConfig(checkpoint_every=2).validate()
    with pytest.raises(ConfigError, match="checkpoint_every must be a whole number from 1 to"):
        RunConfig(checkpoint_dir=str(tmp_path), checkpoint_every=0).validate()
    with pytest.raises(ConfigError, match="already holds checkpoints .* --resume"):
        RunConfig(strategy="ddp", world_size=2, checkpoint_dir=str(saved)).validate()
    with pytest.raises(ConfigError, match="steps must be at most"):
        RunConfig(steps=10**12).validate()


def test_the_data_resume_where_they_stopped():
    """Batches from position k (across an epoch's end) are the unbroken run's batches from k on."""
    data = TokenDataset("gpt-tiny", "synthetic", 24, 8, 64, 0)
    loader, sampler = make_loader(data, 4, 1, 2, 0)
    whole = list(batches(loader, sampler, 3, 8))
    for start in (0, 2, 3, 5):
        loader, sampler = make_loader(data, 4, 1, 2, 0)
        rest = list(batches(loader, sampler, 3, 8, start=start))
        assert len(rest) == 8 - start
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(rest, whole[start:]))


@pytest.mark.parametrize("chain", [
    # flat shards across parameters' ends -> slices (q, k, v each cut by heads) -> whole optimizer partitions
    [("zero3", 2, {}), ("tp-scratch", 2, {}), ("zero1-torch", 2, {}), ("single", 1, {})],
    # rows of experts -> rows of experts sharded by FSDP over their copies -> whole
    [("ep-scratch", 2, {"model": "gpt-moe-tiny"}), ("fsdp", 4, {"model": "gpt-moe-tiny", "ep": 2}),
     ("single", 1, {"model": "gpt-moe-tiny"})],
], ids=["zero3-tp-zero1torch-single", "ep-fsdpxep-single"])
def test_a_local_checkpoint_moves_between_layouts_unchanged(tmp_path, chain):
    """Local layouts (each rank's pieces under its own keys) load under any other through their canonical
    copy, and load a canonical checkpoint by cutting their pieces from it: every tensor bit for bit."""
    folders = []
    for i, (strategy, n, over) in enumerate(chain):
        cfg = RunConfig(strategy=strategy, world_size=n, checkpoint_dir=str(tmp_path / str(i)),
                        resume=str(folders[-1]) if folders else None, **{**BASE, "steps": 2, **over})
        launch(cfg, progress=False)
        folders.append(checkpoint.step_dir(cfg.checkpoint_dir, 2))
    assert checkpoint.read_meta(folders[0])["names"] == "local"
    first = checkpoint.whole(folders[0])[0]  # through its canonical copy, made beside it
    assert folders[0].with_name(folders[0].name + ".canonical").is_dir()
    assert any(k.endswith(".exp_avg_sq") for k in first)
    for folder in folders[1:]:
        again = checkpoint.whole(folder)[0]
        assert again.keys() == first.keys()
        assert [k for k in first if not torch.equal(first[k], again[k])] == []


DEEPSPEED = RESUMED.index(("deepspeed-zero2", 2, {}))


def test_deepspeeds_checkpoint_goes_on_under_another_layout(resumed, tmp_path):
    """DeepSpeed's engine files, through DeepSpeed's universal checkpoint into a canonical copy: one device resumes
    from step 2 and ends its third step where DeepSpeed's unbroken run did (parity's tolerance: another order of
    sums), which it could not with a wrong moment or step count."""
    folder, unbroken = resumed[2][DEEPSPEED], resumed[0][DEEPSPEED][1]
    cfg = RunConfig(strategy="single", resume=str(folder), **BASE)
    (record, weights), = _series([cfg], tmp_path)
    assert record["checkpoint"]["resumed"]["saved_by"]["strategy"] == "deepspeed-zero2"
    assert weights.keys() == unbroken.keys()
    assert max((weights[k] - unbroken[k]).abs().max().item() for k in weights) < 1e-5
    tensors = checkpoint.whole(folder)[0]
    assert {k for k in tensors if k.startswith("optimizer.lm_head.weight.")} == {
        f"optimizer.lm_head.weight.{s}" for s in ("exp_avg", "exp_avg_sq", "step")}  # tied: under both names


def test_deepspeed_takes_another_layouts_checkpoint_unchanged(resumed, tmp_path):
    """One device's step-2 checkpoint into DeepSpeed's engine (each parameter, its fp32 partition and its moments
    set whole through DeepSpeed's safe_set_full_* calls; ZeRO-3's parameters gathered, set, partitioned again),
    saved again by the engine: the weights it trains with, and every tensor of its checkpoint, bit for bit."""
    single = RESUMED.index(("single", 1, {}))
    folder = resumed[2][single]
    first = checkpoint.whole(folder)[0]
    cfgs = [RunConfig(strategy=s, world_size=2, resume=str(folder), checkpoint_dir=str(tmp_path / s),
                      **{**BASE, "steps": 2}) for s in ("deepspeed-zero2", "deepspeed-zero3")]
    for cfg, (record, weights) in zip(cfgs, _series(cfgs, tmp_path / "runs")):
        assert record["checkpoint"]["resumed"]["saved_by"]["strategy"] == "single"
        assert all(torch.equal(weights[k], first[f"model.{k}"]) for k in weights)
        again = checkpoint.whole(checkpoint.step_dir(cfg.checkpoint_dir, 2))[0]
        assert again.keys() == first.keys()
        assert [k for k in first if not torch.equal(first[k], again[k])] == []


def test_deepspeed_moe_reads_only_its_own_engine_files():
    """DeepSpeed-MoE's checkpoint holds the library's module names: another layout is refused with why, before
    any process starts."""
    def meta(strategy, names="deepspeed", dp=2, model="gpt-tiny"):
        cfg = RunConfig(strategy="ddp", world_size=2, **{**BASE, "model": model})
        return {"names": names, "config": {"strategy": strategy}, "grid": {"dp": dp, "pp": 1, "tp": 1},
                "steps_done": 1, "same_run": {k: getattr(cfg, k) for k in checkpoint.SAME_RUN}}

    moe = RunConfig(strategy="single", **{**BASE, "model": "gpt-moe-tiny"})
    assert "DeepSpeed-MoE's modules under the library's names" in checkpoint.compatibility_problems(
        meta("deepspeed-moe", model="gpt-moe-tiny"), moe)[0]
    into = RunConfig(strategy="deepspeed-moe", world_size=2, **{**BASE, "model": "gpt-moe-tiny"})
    assert "reads only its own engine files, with the same degrees" in checkpoint.compatibility_problems(
        meta("ep-scratch", names="local", model="gpt-moe-tiny"), into)[0]


def test_an_exported_checkpoint_is_a_transformers_gpt2_computing_the_same_logits(saved, tmp_path):
    """`python -m multigpu export` writes a folder GPT2LMHeadModel.from_pretrained reads, whose logits are the
    package's GPT's with the checkpoint's weights."""
    import subprocess
    import sys

    from transformers import GPT2LMHeadModel

    from multigpu.models import build_model

    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "multigpu", "export", str(saved), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    theirs = GPT2LMHeadModel.from_pretrained(out).eval()
    ours = build_model("gpt-tiny").eval()
    ours.load_state_dict(checkpoint.whole_weights(saved)[0])
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(input_ids=ids), atol=1e-5, rtol=1e-5)


def test_a_checkpoint_of_plain_sgd_holds_no_optimizer_state_and_still_exports(tmp_path):
    """Plain SGD keeps no optimizer state, so its checkpoint holds the weights alone: reading it whole (and so
    `export`) gives the weights, the very ones the run ended with, instead of a KeyError 'optimizer'."""
    import subprocess
    import sys

    from multigpu import reshard
    from multigpu.models import build_model

    ck = tmp_path / "ck"
    done = subprocess.run([sys.executable, "-m", "multigpu", "run", "--strategy", "single", "--model", "gpt-tiny",
                           "--steps", "1", "--optimizer", "sgd", "--checkpoint-dir", str(ck), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tensors, meta = reshard.whole(ck)
    assert tensors and all(k.startswith("model.") for k in tensors), sorted(tensors)[:3]
    weights, _ = checkpoint.whole_weights(ck)
    assert set(weights) == set(build_model("gpt-tiny").state_dict())
