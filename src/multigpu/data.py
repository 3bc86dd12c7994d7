"""Data: the sources' dummy translation set and a learnable synthetic task.

Both are generated from a seed in every process, so no rank needs to send data to another;
`DistributedSampler` then gives each rank its own 1/N of every epoch.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from multigpu.models import family


def markov_tokens(num_samples: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences from a fixed random Markov chain in which every token has two likely
    successors: a model that learns the chain takes its loss from ln(vocab) towards ln(2)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 2), generator=g)  # the chain to learn
    seq = torch.empty(num_samples, length, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (num_samples,), generator=g)
    for t in range(1, length):
        pick = torch.randint(2, (num_samples,), generator=g)
        seq[:, t] = successors[seq[:, t - 1], pick]
    return seq


class TokenDataset(Dataset):
    """Each item is a dict of equal-length token tensors, ready for `model(**batch)`.

    GPT: `input_ids`, `labels` (the next tokens). T5: `input_ids`, `decoder_input_ids`,
    `labels`, like the sources' dummy translation data set."""

    def __init__(self, model: str, kind: str, num_samples: int, seq_len: int, vocab: int, seed: int):
        decoder_only = family(model) != "t5"  # GPT, or a Hugging Face causal LM
        if kind == "dummy":  # random ids: nothing to learn, cost of a step is all that matters
            g = torch.Generator().manual_seed(seed)
            n_streams = 2 if decoder_only else 3
            streams = torch.randint(vocab, (n_streams, num_samples, seq_len), generator=g)
        else:  # learnable: the loss falls within a CPU demo
            seq = markov_tokens(num_samples, seq_len + 1, vocab, seed)
            streams = torch.stack([seq[:, :-1], seq[:, 1:], seq[:, 1:]])
        if decoder_only:
            self.tensors = {"input_ids": streams[0], "labels": streams[1]}
        else:
            # T5 reads the source, the decoder sees the target shifted right by one
            target = streams[2]
            shifted = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], dim=1)
            self.tensors = {"input_ids": streams[0], "decoder_input_ids": shifted, "labels": target}

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.tensors.items()}


def make_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int):
    """Each rank loads `batch_size` samples at a time from its own shard.

    `rank` and `world_size` are the data-parallel ones: ranks that split a model between
    them (tensor or pipeline parallel) share one data-parallel rank, so they load the same
    samples. `DistributedSampler` shuffles the whole index list with `seed + epoch` (the same on
    every rank) and rank r takes positions r, r+N, r+2N, ... so the N ranks' k-th batches
    together are exactly the k-th global batch a single process would load. The loader's
    own `shuffle` stays off: the sampler does the shuffling."""
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    return loader, sampler


def batches(loader, sampler, steps_per_epoch: int, num_batches: int, start: int = 0):
    """Yield batches `start` to `num_batches - 1`, calling `sampler.set_epoch` at every epoch start so
    that each epoch is shuffled differently (forgetting it repeats epoch 0's order). A resumed run
    starts where the checkpoint left off: the order is a function of the seed and the epoch, so the
    batches done are skipped by position (the sampler's indices, without loading the samples)."""
    epoch, skip = divmod(start, steps_per_epoch)
    num_batches -= start
    if num_batches <= 0:
        return
    while True:
        sampler.set_epoch(epoch)
        loader_iter, left = (iter(loader) if not skip else _from(loader, skip)), steps_per_epoch - skip
        skip = 0
        for i, batch in enumerate(loader_iter):
            if i == left:
                break
            yield batch
            num_batches -= 1
            if num_batches == 0:
                return
        epoch += 1


def _from(loader, skip: int):
    """The loader's batches from the `skip`-th on, this epoch: its sampler's order without the first
    skip x batch_size indices (the samples themselves are never loaded)."""
    indices = list(iter(loader.sampler))[skip * loader.batch_size:]
    for i in range(0, len(indices) - loader.batch_size + 1, loader.batch_size):
        yield loader.collate_fn([loader.dataset[j] for j in indices[i:i + loader.batch_size]])
