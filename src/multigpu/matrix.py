"""The parity matrix: every composition of data, tensor, pipeline and context parallelism at degree 2 that
fits in 8 processes, for a dense model and for a mixture of experts (its experts cut over 2 ranks), each
checked against one device (`check`: fp32, 3 steps, 1e-5) in one command: `python -m multigpu check --matrix`.

A composition is the set of dimensions cut in two; the strategy that runs it is the one the package composes
them with: FSDP for the data-parallel ranks (sharded), a library pipeline (1F1B, two micro-batches) when the
layers are cut, tensor and context parallelism inside either (compose.py's order). A mixture of experts
takes expert parallelism from its data-parallel ranks (`fsdp --ep 2`, torchtitan's dp2ep); what the package
has not built (experts beside tensor, pipeline or context parallelism) is a cell that says so, with the
message a run would refuse with. Users of the anchors post such matrices of losses over tens of layouts to
find which train alike (torchtitan issue 3029); here each cell is a parity check.
"""

from __future__ import annotations

from itertools import combinations

from multigpu.errors import ConfigError

DIMS = ("dp", "tp", "pp", "cp")
MAX_PROCESSES = 8
DENSE, MOE = "gpt-mini", "gpt-moe-tiny"  # 4 blocks (two pipeline stages of two); 2 blocks with 8 experts


def cases(max_processes: int = MAX_PROCESSES) -> list[dict]:
    """Every cell: {"composition", "model", "strategy", "processes", "options"}: the dense model over each
    non-empty set of DIMS whose product fits, the mixture of experts over dp (its experts cut over the 2 dp
    ranks) with each set of the other three that fits."""
    out = []
    for model, required in ((DENSE, ()), (MOE, ("dp",))):
        rest = [d for d in DIMS if d not in required]
        for k in range(0 if required else 1, len(rest) + 1):
            for chosen in combinations(rest, k):
                cut = (*required, *chosen)
                processes = 2 ** len(cut)
                if processes > max_processes:
                    continue
                pipeline = "pp" in cut
                options = {d: 2 for d in cut if d in ("tp", "pp", "cp")}
                if pipeline:
                    options["grad_accum_steps"] = 2
                if model == MOE:
                    options["ep"] = 2
                name = " x ".join(d.upper() for d in DIMS if d in cut) + (" (EP 2 from DP)" if model == MOE else "")
                out.append({"composition": name, "model": model, "strategy": "pp-1f1b" if pipeline else "fsdp",
                            "processes": processes, "options": options})
    return out


def refusal(cell: dict) -> str | None:
    """The message a run of `cell` is refused with before any process starts, or None: it can run."""
    from multigpu.check import parity_configs

    try:
        parity_configs(cell["strategy"], cell["processes"], model=cell["model"], **cell["options"])
    except (ConfigError, ValueError) as err:
        return str(err)
    return None


def run(cells: list[dict] | None = None, *, steps: int = 3, tolerance: float = 1e-5,
        device: str = "auto") -> list[dict]:
    """Each cell checked against one device (the runs of a process count in one series), or its refusal:
    the cell with "status" ("passed", "FAILED", "not built"), the largest weight and loss differences, and
    the refusal's or the failure's message. `device`: every cell's ("auto": the device plan's for its
    processes, so on a machine of 2 to 7 GPUs the larger cells run on the CPU)."""
    from multigpu.check import check_series

    cells = [{**c, "options": {**c["options"], "device": device}} for c in (cases() if cells is None else cells)]
    refused = [refusal(c) for c in cells]
    runnable = [c for c, why in zip(cells, refused) if why is None]
    results = iter(check_series([(c["strategy"], c["processes"], {"model": c["model"], **c["options"]})
                                 for c in runnable], steps=steps, tolerance=tolerance) if runnable else [])
    out = []
    for cell, why in zip(cells, refused):
        row = {**cell, "max_abs_param_diff": None, "max_abs_loss_diff": None, "message": why or ""}
        if why is not None:
            row["status"] = "not built"
        else:
            result = next(results)
            if isinstance(result, Exception):
                row.update(status="FAILED", message=f"{type(result).__name__}: {result}")
            else:
                row.update(status="passed" if result["passed"] else "FAILED",
                           max_abs_param_diff=result["max_abs_param_diff"],
                           max_abs_loss_diff=result["max_abs_loss_diff"], device=result.get("device"))
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    """The matrix as lines of text, one cell a line."""
    lines = [f"{'composition':<34} {'model':<13} {'strategy':<8} {'ranks':>5}  {'result':<9} max |weight diff|"]
    for r in rows:
        diff = f"{r['max_abs_param_diff']:.1e}" if r["max_abs_param_diff"] is not None else ""
        lines.append(f"{r['composition']:<34} {r['model']:<13} {r['strategy']:<8} {r['processes']:>5}  "
                     f"{r['status']:<9} {diff}")
        if r["status"] != "passed" and r["message"]:
            lines.append(f"    {r['message'][:300]}")
    return "\n".join(lines)


def cmd_matrix(args) -> int:
    """`check --matrix`: the table (or `--json` rows); exit 1 if a built cell fails."""
    import json

    rows = run(steps=args.steps, tolerance=args.tolerance, device=args.device)
    print(json.dumps(rows) if args.json else table(rows))
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0
