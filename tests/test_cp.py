"""Context parallelism: the attention of a sequence cut over cp ranks equals PyTorch's on the whole
sequence, output and gradients; its bytes are the formulas'; its schedule's work is balanced by
the zig-zag layout; and what cannot be cut is refused before any process starts.

The attention checks run in `spmd.cp_checks` (tests/spmd/) on 2 and 4 gloo processes in
float64. Training parity of the strategies (cp-scratch, fsdp --cp) against one device is in
test_parity.py, with every other strategy's.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from multigpu.config import ConfigError, RunConfig
from multigpu.spmd import run_spmd
from multigpu.strategies import cp_attention as cpa

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8


def attention(cp: int) -> list[dict]:
    return run_spmd("spmd.cp_checks:attention_checks", cp, batch=BATCH, heads=HEADS, seq_len=SEQ, head_dim=HEAD_DIM)


_runs: dict[int, list[dict]] = {}


def checked(cp: int) -> list[dict]:
    if cp not in _runs:
        _runs[cp] = attention(cp)
    return _runs[cp]


@pytest.mark.parametrize("cp", [2, 4])
def test_every_variant_matches_one_device_attention(cp):
    """Output and the three input gradients, every variant x layout x mask, on every rank: equal to
    SDPA on the whole sequence to float64 rounding."""
    results = checked(cp)
    assert len(results) == cp
    keys = {f"{v}/{b}/{m}" for v, b, m in itertools.product(cpa.VARIANTS, cpa.BALANCES, ("causal", "full"))}
    for rank, result in enumerate(results):
        assert set(result) == keys
        for key, diffs in result.items():
            for quantity in ("out", "dq", "dk", "dv"):
                assert diffs[quantity] < 1e-12, (cp, rank, key, quantity, diffs[quantity])


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_sent_are_the_formulas(cp):
    """What the comm counter saw each rank send, forward and in all, against
    cp_attention.sent_bytes_per_layer (float64: 8 bytes a value)."""
    for result in checked(cp):
        for variant, balance in itertools.product(cpa.VARIANTS, cpa.BALANCES):
            seen = result[f"{variant}/{balance}/causal"]
            formula = cpa.sent_bytes_per_layer(variant, cp, BATCH, HEADS, SEQ, HEAD_DIM, 8)
            assert sum(seen["forward_sent"].values()) == formula["forward"], (variant, seen)
            assert sum(seen["sent"].values()) == formula["forward"] + formula["backward"], (variant, seen)


def test_bytes_formulas_at_a_glance():
    """One layer, cp 4, 1 x 8 heads x 4096 tokens x 128, bf16: keys and values of one rank are
    2 x 8 x 1024 x 128 x 2 bytes = 4 MiB. The ring passes them on 3 times forward, and backward 3
    times more with 4 passes of their gradients; Ulysses moves 3/4 of q, k, v and the output each way."""
    mib = 2**20
    ring = cpa.sent_bytes_per_layer("ring", 4, 1, 8, 4096, 128, 2)
    assert (ring["forward"] / mib, ring["backward"] / mib) == (12, 28)
    gather = cpa.sent_bytes_per_layer("allgather", 4, 1, 8, 4096, 128, 2)
    assert (gather["forward"] / mib, gather["backward"] / mib) == (12, 12)
    ulysses = cpa.sent_bytes_per_layer("ulysses", 4, 1, 8, 4096, 128, 2)
    assert (ulysses["forward"] / mib, ulysses["backward"] / mib) == (6, 6)


def _brute_force_blocks(cp: int, balance: str, rank: int) -> int:
    """Blocks of chunk x chunk scores holding at least one unmasked entry, found from the causal
    mask of the whole sequence itself (not from the schedule's rule)."""
    per = cp * cpa.chunks_per_rank(balance)
    seq = per * 3  # three tokens a chunk
    pos = range(seq)
    mine = cpa.positions(seq, cp, rank, balance).tolist()
    blocks = set()
    for q in mine:
        for k in pos:
            if q >= k:
                blocks.add((q // 3, k // 3))
    return len(blocks)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_schedule_is_the_masks_work(cp):
    for balance in cpa.BALANCES:
        schedule = cpa.ChunkSchedule(cp, balance, causal=True)
        for rank in range(cp):
            assert schedule.blocks(rank) == _brute_force_blocks(cp, balance, rank), (balance, rank)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_the_causal_work(cp):
    """Contiguous chunks: rank r computes r + 1 blocks, the last rank cp, so the slowest does
    2cp / (cp + 1) times the mean. Zig-zag: every rank 2cp + 1 blocks of a quarter the size."""
    flops = {b: [cpa.ChunkSchedule(cp, b, True).flops(r, 1, 1, 8 * cp, 4) for r in range(cp)] for b in cpa.BALANCES}
    naive, zigzag = flops["contiguous"], flops["zigzag"]
    assert max(naive) / (sum(naive) / cp) == pytest.approx(2 * cp / (cp + 1))
    assert len(set(zigzag)) == 1
    assert sum(zigzag) < sum(naive)  # smaller diagonal blocks: less of the masked half computed
    full = [cpa.ChunkSchedule(cp, "contiguous", False).flops(r, 1, 1, 8 * cp, 4) for r in range(cp)]
    assert full == [4 * (8 * cp) ** 2 // cp * 4] * cp  # without the mask: the whole S x S / cp each


def test_layouts_cover_the_sequence_once():
    for cp, balance in itertools.product([1, 2, 3, 4], cpa.BALANCES):
        seq = 4 * cp
        got = torch.cat([cpa.positions(seq, cp, r, balance) for r in range(cp)])
        assert sorted(got.tolist()) == list(range(seq))
    assert cpa.layout(4, "zigzag") == [[0, 7], [1, 6], [2, 5], [3, 4]]


def refused(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        RunConfig(**fields).validate()
    return str(info.value)


def test_bad_input_is_refused_before_any_process_starts():
    message = refused(strategy="cp-scratch", world_size=4, seq_len=36)  # zig-zag: 8 chunks
    assert "does not cut into 8 equal chunks (zigzag layout on cp=4" in message and "multiple of 8" in message
    RunConfig(strategy="cp-scratch", world_size=4, seq_len=36, extra={"cp_balance": "contiguous"}).validate()
    message = refused(strategy="cp-scratch", world_size=8, extra={"cp_attention": "ulysses"})  # gpt-tiny: 4 heads
    assert "Ulysses gives each of the cp=8 ranks whole heads, and a rank has 4 head(s)" in message
    message = refused(strategy="ddp", world_size=4, cp=2)
    assert "does not combine with cp (cp=2)" in message and "--strategy cp-scratch" in message
    assert "this run has cp 1" in refused(strategy="fsdp", world_size=2, extra={"cp_attention": "ring"})
    assert "not one of: ring, allgather, ulysses" in refused(strategy="cp-scratch", world_size=2,
                                                             extra={"cp_attention": "flash"})
    assert "not 't5-tiny'" in refused(strategy="cp-scratch", world_size=2, model="t5-tiny")
    scratch_pipeline = refused(strategy="pp-1f1b-scratch", world_size=4, cp=2, pp=2)
    assert "a library pipeline (pp-1f1b, pp-gpipe, ...) with --cp N" in scratch_pipeline
    assert "fsdp or ddp-scratch with --tp" in refused(strategy="cp-scratch", world_size=4, cp=2, tp=2)
    from multigpu.strategies.cp_scratch import context_problems

    sixteen = RunConfig(strategy="fsdp", world_size=16, cp=4, tp=4, seq_len=40, extra={"sequence_parallel": True})
    assert any("a multiple of 16" in p for p in context_problems(sixteen))  # (16 processes: more than this CPU runs)
    assert "world size 6 is not a multiple of pp 1 x cp 4 x tp 1 = 4" in refused(strategy="fsdp", world_size=6, cp=4)


@pytest.mark.parametrize("strategy, world_size, cp, dp, expected", [
    ("cp-scratch", 4, 1, None, {"dp": 1, "pp": 1, "tp": 1, "cp": 4}),  # cp spans the world
    ("cp-scratch", 4, 2, None, {"dp": 2, "pp": 1, "tp": 1, "cp": 2}),  # given: the rest are dp ranks
    ("fsdp", 4, 2, None, {"dp": 2, "pp": 1, "tp": 1, "cp": 2}),
    ("fsdp", 8, 4, None, {"dp": 2, "pp": 1, "tp": 1, "cp": 4}),
])
def test_cp_degrees(strategy, world_size, cp, dp, expected):
    cfg = RunConfig(strategy=strategy, world_size=world_size, cp=cp, dp=dp).validate()
    assert cfg.degrees == expected
    assert cfg.per_rank_batch_size == cfg.global_batch_size // expected["dp"]  # cp ranks share their samples


@pytest.mark.parametrize("diagonal", [True, False])
def test_the_fused_block_kernels_are_the_arithmetic(diagonal):
    """The ring's blocks run on PyTorch's fused kernel where it has one (here the CPU's flash
    attention); forward and backward must equal the explicit arithmetic of cp_attention, with the
    final output and log-sum-exp of a longer row (as the ring's backward passes them)."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 16, 8, dtype=torch.float64) for _ in range(4))
    scale = 8 ** -0.5
    out, lse = cpa._block_forward(q, k, v, scale, diagonal)
    ref_out, ref_lse = cpa._block_forward_math(q, k, v, scale, diagonal)
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    final_out, final_lse = torch.randn_like(out), ref_lse + torch.rand_like(ref_lse)  # as if other keys were seen
    fused = cpa._block_backward(q, k, v, dout, final_out, final_lse, scale, diagonal)
    math = cpa._block_backward_math(q, k, v, dout, final_out, final_lse, scale, diagonal)
    for a, b in zip(fused, math):
        assert (a - b).abs().max() < 1e-12


def test_pytorchs_context_parallel_raises_on_a_cpu(tmp_path):
    """What the refusal rests on, against the library itself: PyTorch's context_parallel on one
    gloo rank, a causal SDPA on the CPU inside it. The CPU's kernel is not among the ones it
    replaces, and DTensor has no sharding rule for it: the first attention raises."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    assert all("_for_cpu" not in str(op) for op in torch_cp.custom_ops)
    sdpa = F.scaled_dot_product_attention
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        x = torch.randn(1, 2, 8, 4)  # batch x heads x tokens x head width
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2], no_restore_buffers={x}):
                q = x.detach().requires_grad_()
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    finally:
        dist.destroy_process_group()
    assert F.scaled_dot_product_attention is sdpa  # the context put attention back


def test_pytorchs_context_parallel_is_refused_off_cuda_with_the_reason():
    """The strategy refuses the CPU before any process starts, says why (the error above) and names
    the one that runs."""
    from multigpu.launch import launch

    for device in ("cpu", "auto"):  # this machine has no GPU: auto cannot fall back to the CPU either
        with pytest.raises(ConfigError) as info:
            launch(RunConfig(strategy="cp", world_size=2, device=device), progress=False)
        message = str(info.value)
        assert "_scaled_dot_product_flash_attention_for_cpu" in message and "NotImplementedError" in message, message
        assert "--strategy cp-scratch" in message and "this machine has 0" in message, message
    assert "not 'ulysses'" in refused(strategy="cp", world_size=2, extra={"cp_attention": "ulysses"})


def test_the_estimator_counts_what_each_way_of_attention_keeps():
    """The estimator's allgather and Ulysses (share.cp_attention_extra) against every committed
    cp_variants run of them: forward's saved activations within a page of the tracker's, per rank;
    and what it refuses: a Ulysses cp that does not divide the heads, a way it does not know."""
    from multigpu import records
    from multigpu.estimator import Setup, estimate, saved_activations
    from multigpu.estimator.accuracy import setup_of

    runs = [r for r in records.load("cp_variants") if r["config"]["extra"]["cp_attention"] != "ring"]
    assert {r["config"]["extra"]["cp_attention"] for r in runs} == {"allgather", "ulysses"}
    for r in runs:
        setup = setup_of(r, against="tracker")
        found = saved_activations(estimate(setup, r["config"]["global_batch_size"]))
        assert abs(found - r["saved_activation_bytes_by_rank"][0]) <= 4096 * 32, (setup.cp_attention, setup.cp)
        ring = saved_activations(estimate(replace(setup, cp_attention="ring"), r["config"]["global_batch_size"]))
        assert found > ring
    with pytest.raises(ConfigError, match="whole heads"):
        estimate(Setup("gpt-long", "cp-scratch", 16, seq_len=8192, cp_attention="ulysses"))
    with pytest.raises(ConfigError, match="one of ring, allgather, ulysses"):
        estimate(Setup("gpt-long", "cp-scratch", 2, seq_len=8192, cp_attention="flash"))
