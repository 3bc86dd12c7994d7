"""A checkpoint's folder on disk: `DIR/step-00000010` (renamed into place only when whole), its
files, one a rank (DCP's `__R_0.distcp`, DeepSpeed's own), and `meta.json`, written last, which
lists every file with its size. What saves and loads checkpoints is multigpu.checkpoint; what
puts one together whole under the single-device names, multigpu.reshard."""

from __future__ import annotations

import json
import re
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
    found = complete(path)
    if not found:
        partial = sorted(path.glob("step-*")) if path.is_dir() else []
        raise CheckpointError(
            f"no complete checkpoint in {path}" + (f" (only {', '.join(p.name for p in partial)}, which lack {META}: "
                                                    "saves cut short)" if partial else "")
            + "; give a folder a run wrote with --checkpoint-dir, or one of its step-N folders")
    return found[-1]


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
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(wrong)}. Nothing was loaded; resume from "
                              f"an earlier step-N folder beside it")
    return meta


def flat_state(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(flat_state(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
