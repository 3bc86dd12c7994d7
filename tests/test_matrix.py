"""The parity matrix (multigpu.matrix, `check --matrix`): its cells, what each refuses, and a run of a few."""

from __future__ import annotations

import pytest

from multigpu import matrix


def test_the_cells_are_every_composition_that_fits():
    cells = matrix.cases()
    dense = [c for c in cells if c["model"] == matrix.DENSE]
    assert len(dense) == 14 and all(c["processes"] <= 8 for c in cells)  # 4 + 6 + 4 sets of 4 dimensions
    assert len(cells) - len(dense) == 7  # dp with each set of at most two of tp, pp, cp
    assert {c["processes"] for c in dense} == {2, 4, 8}
    assert all(matrix.refusal(c) is None for c in dense), "every dense composition is built"
    for cell in cells:
        if cell["model"] == matrix.MOE and set(cell["options"]) & {"tp", "pp", "cp"}:
            assert matrix.refusal(cell), cell  # not built: refused with what to do, before any process


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_marks_each_cell():
    cells = [c for c in matrix.cases() if c["composition"] in ("DP", "DP (EP 2 from DP)", "DP x TP (EP 2 from DP)")]
    rows = matrix.run(cells)
    assert [r["status"] for r in rows] == ["passed", "passed", "not built"], rows
    assert rows[0]["max_abs_param_diff"] <= 1e-5 and "not yet with --tp" in rows[2]["message"]
    assert "not built" in matrix.table(rows)
