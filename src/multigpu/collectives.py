"""Collective algorithms, step by step.

`ring_all_reduce_steps` plays the ring all-reduce of Patarasuk and Yuan (2009) on plain
Python numbers, one chunk per rank, and returns every intermediate state, so that a chapter
can show who holds what after each step and count what each rank sent.
"""

from __future__ import annotations


def ring_all_reduce_steps(values: list[list[float]]) -> list[dict]:
    """values[r][c]: rank r's chunk c (N ranks, N chunks each). Returns one entry per step:
    {'phase', 'step', 'state' (deep copy), 'sent_chunks' (per rank)}.

    Reduce-scatter (N-1 steps): at step s rank r sends chunk (r - s) mod N to rank r+1,
    which adds it to its own. Afterwards rank r holds the full sum of chunk (r + 1) mod N.
    All-gather (N-1 steps): at step s rank r sends its finished chunk (r + 1 - s) mod N to
    rank r+1, which overwrites its copy. Each rank sends 2(N-1) chunks of size 1/N of the
    data: 2(N-1)/N of it, whatever N is."""
    n = len(values)
    state = [list(row) for row in values]
    history = [{"phase": "start", "step": 0, "state": [list(r) for r in state], "sent_chunks": [0] * n}]
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            offset = 0 if phase == "reduce-scatter" else 1
            # every rank sends at once; read all outgoing chunks before anyone updates
            outgoing = [(r, (r - s + offset) % n, state[r][(r - s + offset) % n]) for r in range(n)]
            for r, chunk, value in outgoing:
                dst = (r + 1) % n
                state[dst][chunk] = state[dst][chunk] + value if phase == "reduce-scatter" else value
                sent[r] += 1
            history.append({"phase": phase, "step": s + 1, "state": [list(r) for r in state],
                            "sent_chunks": list(sent)})
    return history
