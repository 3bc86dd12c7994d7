"""Model presets against published parameter counts and closed-form formulas; data
sharding against a single-process loader and PyTorch's own DistributedSampler semantics."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from multigpu.data import TokenDataset, batches, make_loader, markov_tokens
from multigpu.models import GPT_SIZES, T5_SIZES, build_model, parameter_count, t5_config

# -- parameter counts -----------------------------------------------------------------


def gpt_formula(vocab: int, n_layer: int, d: int, seq_len: int, moe=None) -> int:
    """GPT-2 with a tied head. Per block: qkv 3d^2+3d, attention proj d^2+d, MLP 4d^2+4d
    and 4d^2+d, two LayerNorms 4d: 12d^2 + 13d. Plus token and position tables, final LN.
    A mixture of experts' block: a router d x E and E (plus shared) MLPs of width f in place of the MLP."""
    mlp = 8 * d * d + 5 * d
    if moe is not None:
        f = moe.d_ff or 4 * d
        mlp = d * moe.experts + (moe.experts + moe.shared_experts) * (2 * d * f + f + d)
    return n_layer * (4 * d * d + 8 * d + mlp) + vocab * d + seq_len * d + 2 * d


def t5_formula(d_model: int, d_ff: int, d_kv: int, num_heads: int, num_layers: int, vocab_size: int = 32128) -> int:
    """T5 v1.0 (ReLU FFN, no biases, RMS-norm weights only, head tied to the embedding).
    Attention: q, k, v, o = 4 * d_model * (heads * d_kv); relative position bias (32
    buckets x heads) in the first layer of each stack; one final norm per stack."""
    d, inner = d_model, num_heads * d_kv
    attention, ffn, rel_bias = 4 * d * inner, 2 * d * d_ff, 32 * num_heads
    encoder = num_layers * (attention + ffn + 2 * d) + rel_bias + d
    decoder = num_layers * (2 * attention + ffn + 3 * d) + rel_bias + d
    return vocab_size * d + encoder + decoder


def test_gpt_formula_reproduces_the_published_gpt2_count():
    """124,439,808: GPT-2 small as released (Hugging Face `gpt2`, tied embeddings)."""
    assert gpt_formula(50257, 12, 768, 1024) == 124_439_808


@pytest.mark.parametrize("name", list(GPT_SIZES))
def test_gpt_presets_match_the_formula(name):
    c = GPT_SIZES[name]
    assert parameter_count(name) == gpt_formula(c.vocab_size, c.n_layer, c.d_model, c.seq_len, c.moe)


@pytest.mark.parametrize("name, published", [
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200),
])
def test_gpt2_presets_match_the_released_models(name, published):
    assert parameter_count(name) == published


@pytest.mark.parametrize("name", list(T5_SIZES))
def test_t5_presets_match_the_formula(name):
    sizes = {k: v for k, v in T5_SIZES[name].items() if k != "dropout_rate"}
    assert parameter_count(name) == t5_formula(**sizes)


@pytest.mark.parametrize("name", list(T5_SIZES))
def test_t5_presets_keep_the_released_dropout_except_the_test_model(name):
    # the released config.json files say dropout_rate 0.1; t5-tiny trains the parity tests, where
    # every rank must draw the same (no) masks as one device
    model = build_model(name) if name == "t5-tiny" else None
    rate = t5_config(name).dropout_rate
    assert rate == (0.0 if name == "t5-tiny" else 0.1)
    if model is not None:
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


@pytest.mark.parametrize("name, published", [
    ("t5-small", 60.5e6), ("t5-base", 222.9e6), ("t5-large", 737.7e6), ("t5-3b", 2.85e9),
])
def test_t5_presets_match_the_released_checkpoints(name, published):
    """Sizes of the released T5 checkpoints (Raffel et al. 2020), within 1%."""
    assert parameter_count(name) == pytest.approx(published, rel=0.01)


def test_same_seed_same_weights():
    """Every rank builds its replica from the seed: equal seeds, equal weights."""
    a, b, c = build_model("gpt-tiny", 0), build_model("gpt-tiny", 0), build_model("gpt-tiny", 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


# -- data --------------------------------------------------------------------------------

SEED = 3


def rows(batch: dict) -> list[tuple]:
    """The samples of a batch, as hashable rows of every stream (input ids and labels)."""
    return [tuple(torch.cat([batch[k][i] for k in sorted(batch)]).tolist()) for i in range(len(batch["labels"]))]


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset("gpt-tiny", "synthetic", num_samples=48, seq_len=16, vocab=128, seed=SEED)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_load_the_global_batch(dataset, world_size):
    """For every k, over two epochs: the union of the N ranks' k-th batches (b samples each)
    is the k-th batch of one process loading N*b at a time, and the ranks never overlap."""
    b = 2
    steps_per_epoch = len(dataset) // (world_size * b)
    n = 2 * steps_per_epoch
    loader, sampler = make_loader(dataset, world_size * b, 0, 1, SEED)
    global_batches = list(batches(loader, sampler, steps_per_epoch, n))
    per_rank = []
    for rank in range(world_size):
        loader, sampler = make_loader(dataset, b, rank, world_size, SEED)
        per_rank.append(list(batches(loader, sampler, steps_per_epoch, n)))
    assert len(global_batches) == n and all(len(r) == n for r in per_rank)
    for k in range(n):
        union = [row for r in per_rank for row in rows(r[k])]
        assert all(len(rows(r[k])) == b for r in per_rank)
        assert Counter(union) == Counter(rows(global_batches[k])), f"batch {k}"
    for epoch in range(2):  # one epoch: the ranks split the data set between them
        seen = [row for r in per_rank for batch in r[epoch * steps_per_epoch:(epoch + 1) * steps_per_epoch]
                for row in rows(batch)]
        assert Counter(seen) == Counter(rows(dataset[list(range(len(dataset)))]))


def test_set_epoch_reshuffles_and_forgetting_it_repeats(dataset):
    b = 4
    steps_per_epoch = len(dataset) // b
    loader, sampler = make_loader(dataset, b, 0, 1, SEED)
    got = [row for batch in batches(loader, sampler, steps_per_epoch, 2 * steps_per_epoch) for row in rows(batch)]
    epoch0, epoch1 = got[:len(dataset)], got[len(dataset):]
    assert Counter(epoch0) == Counter(epoch1)  # the same samples ...
    assert epoch0 != epoch1  # ... in another order
    # reference: PyTorch's DistributedSampler, told the epoch by hand
    sampler.set_epoch(1)
    assert [row for batch in loader for row in rows(batch)] == epoch1
    # without set_epoch, every pass over the loader repeats the same order
    loader, _ = make_loader(dataset, b, 0, 1, SEED)
    first = [row for batch in loader for row in rows(batch)]
    second = [row for batch in loader for row in rows(batch)]
    assert first == second == epoch0


def test_gpt_labels_are_the_next_tokens(dataset):
    x, y = dataset.tensors["input_ids"], dataset.tensors["labels"]
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_t5_decoder_sees_the_target_shifted_right():
    ds = TokenDataset("t5-tiny", "dummy", num_samples=4, seq_len=8, vocab=512, seed=0)
    target, shifted = ds.tensors["labels"], ds.tensors["decoder_input_ids"]
    assert torch.equal(shifted[:, 1:], target[:, :-1])
    assert (shifted[:, 0] == 0).all()  # decoder_start_token_id


def test_synthetic_task_is_learnable():
    """Every token is followed by one of at most 2 tokens, so the best possible loss is
    ln 2, far below the ln(vocab) of an untrained model: there is something to learn."""
    seq = markov_tokens(num_samples=64, length=65, vocab=128, seed=0)
    successors: dict[int, set[int]] = {}
    for a, b in zip(seq[:, :-1].flatten().tolist(), seq[:, 1:].flatten().tolist(), strict=True):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 2
    assert any(len(s) == 2 for s in successors.values())  # and really random between two


# -- choosing a T5's attention (hf.set_attention) ----------------------------------------------

def _attention_of_every_layer(model) -> set:
    return {m.config._attn_implementation for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                                 "_attn_implementation")}


def test_set_attention_reaches_the_encoder_and_decoder_whatever_transformers_does(monkeypatch):
    """transformers 5.17's switch on the whole T5 left its encoder and decoder on SDPA (their configs
    are copies of the same class, which it skipped): emulated here by a switch that changes only the
    model it is called on. set_attention still reaches every layer, both ways."""
    from transformers import PreTrainedModel

    from multigpu.hf import set_attention

    monkeypatch.setattr(PreTrainedModel, "set_attn_implementation",
                        lambda self, name: setattr(self.config, "_attn_implementation_internal", name))
    model = build_model("t5-tiny", 0)
    model.set_attn_implementation("eager")
    assert _attention_of_every_layer(model) == {"eager", "sdpa"}  # the old switch alone: half the layers
    set_attention(model, "eager")
    assert _attention_of_every_layer(model) == {"eager"}
    set_attention(model, "sdpa")
    assert _attention_of_every_layer(model) == {"sdpa"}


def test_set_attention_refuses_a_switch_that_does_not_take(monkeypatch):
    from transformers import PreTrainedModel

    from multigpu.hf import set_attention

    monkeypatch.setattr(PreTrainedModel, "set_attn_implementation", lambda self, name: None)
    with pytest.raises(RuntimeError, match="would not compute what it says"):
        set_attention(build_model("t5-tiny", 0), "eager")
