"""A checkpoint's folder on disk: `DIR/step-00000010` (renamed into place only when whole), its
files, one a rank (DCP's `__R_0.distcp`, DeepSpeed's own), and `meta.json`, written last, which
lists every file with its size and its checksum (CRC-32: a file damaged at the same size is found too,
before anything is loaded). What saves and loads checkpoints is multigpu.checkpoint; what puts one
together whole under the single-device names, multigpu.reshard."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from multigpu.errors import ConfigError

FORMAT = 1
META = "meta.json"
_STEP = re.compile(r"step-(\d{8})")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: what is wrong with it, and what to do instead."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete(root: str | Path) -> list[Path]:
    """The finished checkpoints under `root`, oldest first (a `.partial` folder is a save cut short)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP.fullmatch(p.name) and (p / META).exists())


def resolve(path: str | Path) -> Path:
    """A checkpoint folder itself, or the newest complete one under a run's checkpoint folder."""
    path = Path(path)
    if (path / META).exists():
        return path
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a folder a run wrote with --checkpoint-dir, or one of "
                              "its step-N folders")
    found = complete(path)
    if not found:
        partial = sorted(path.glob("step-*")) if path.is_dir() else []
        raise CheckpointError(
            f"no complete checkpoint in {path}" + (f" (only {', '.join(p.name for p in partial)}, which lack {META}: "
                                                    "saves cut short)" if partial else "")
            + "; give a folder a run wrote with --checkpoint-dir, or one of its step-N folders")
    return found[-1]


def skipped(path: str | Path, chosen: Path) -> list[str]:
    """The step folders under a run's checkpoint folder `path` newer than the one `resolve` chose, which it
    passed over because they lack meta.json (saves cut short, or damaged): for a note to the user."""
    path = Path(path)
    if (path / META).exists() or not path.is_dir():
        return []
    return [p.name for p in sorted(path.glob("step-*")) if (m := _STEP.match(p.name)) and p.is_dir()
            and int(m[1]) > int(_STEP.match(chosen.name)[1]) and not (p / META).exists()]


def _rank_of(name: str) -> int | None:
    """Which rank wrote a checkpoint file: DCP's `__R_0.distcp`, DeepSpeed's `zero_pp_rank_R_...` (its
    `mp_rank_00_model_states.pt` is rank 0's)."""
    if m := re.match(r"__(\d+)_\d+\.distcp$", name) or re.match(r"(?:bf16_)?zero_pp_rank_(\d+)_", name):
        return int(m[1])
    return 0 if name.startswith("mp_rank_") else None


def files_of(folder: Path) -> dict[str, int]:
    """Every file of a checkpoint folder (but meta.json) and its size in bytes."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != META}


def checksum(file: Path) -> str:
    """A file's CRC-32, as hex: it finds damage, not tampering, and reads at the disk's pace (about 2 GB/s
    on one core, five times BLAKE2b's), so that checking a large checkpoint before a run costs seconds."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def owner(name: str, world_size: int) -> int:
    """The rank that checksums a file at a save: the rank that wrote it (its page cache holds it), else rank 0."""
    rank = _rank_of(Path(name).name)
    return rank if rank is not None and rank < world_size else 0


def damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged: {what}. Nothing was loaded; resume from an earlier "
                           "step-N folder beside it")


def verify(path: Path, meta: dict) -> None:
    """Every file's checksum against meta.json's (a checkpoint saved before checksums: its sizes only, as
    read_meta checks them), and DCP's index readable: before any process loads it."""
    import torch.distributed.checkpoint as dcp

    changed = [name for name, digest in meta.get("checksums", {}).items() if checksum(path / name) != digest]
    if changed:
        raise damaged(path, f"{', '.join(changed)} ({'has' if len(changed) == 1 else 'have'} the size written but "
                            "not the bytes: checksum differs)")
    if (path / ".metadata").exists():
        try:
            dcp.FileSystemReader(path).read_metadata()
        except Exception as err:  # (pickle's, zip's, anything a damaged index raises)
            raise damaged(path, f".metadata cannot be read ({type(err).__name__}: {str(err)[:80]})") from None


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint folder, after checking that every file it lists is there, whole."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a complete checkpoint: its {META} cannot be read ({err}); "
                              "use an earlier step-N folder, or start the run anew") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is in checkpoint format {meta.get('format')!r}; this package reads {FORMAT}")
    wrong = [f"{name} ({'missing' if not (path / name).exists() else f'{(path / name).stat().st_size} bytes'}, "
             f"written with {size})" for name, size in meta["files"].items()
             if not (path / name).exists() or (path / name).stat().st_size != size]
    if wrong:
        raise damaged(path, "; ".join(wrong))
    return meta


def flat_state(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(flat_state(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
