"""Model presets: a small GPT written here, and Hugging Face T5 built from its configs.

The models know nothing of parallelism: strategies are applied to them from outside.
Every preset builds from numbers in this file; nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from multigpu.errors import ConfigError
from multigpu.loss import loss_from_logits  # noqa: F401 - also where callers have found it
from multigpu.moe import MLP, MoE, MoEConfig, aux_loss  # MLP: a block's, dense (moe.py: it is an expert's too)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int  # longest sequence the position table holds
    tie_embeddings: bool = True  # the head reuses the token embedding's weight (GPT-2)
    moe: MoEConfig | None = None  # a mixture of experts in place of every block's MLP (moe.py)

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive whole number, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"the width ({self.d_model}) must split evenly over the {self.n_head} attention heads")

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


class CausalSelfAttention(nn.Module):
    """Queries, keys and values from one fused projection whose output features are
    [queries | keys | values], each of `n_head` heads. Nothing below counts heads: they are
    read from the shapes, so a tensor-parallel rank that holds its slice of each third
    (heads r*H/tp ... of the queries, keys and values alike) runs this same code on its
    own heads. `attend(q, k, v)`: causal SDPA, or context parallelism's (cp_scratch.parallelize)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attend = None  # None: causal SDPA, looked up when called (PyTorch's context_parallel patches it)

    def forward(self, x):  # x: (batch, seq, d_model)
        qkv = self.qkv(x)  # (batch, seq, 3 * heads * head_dim); under sequence parallelism the
        B, T, _ = qkv.shape  # projection gathers the sequence, so its length is read here
        q, k, v = qkv.chunk(3, dim=2)  # each (batch, seq, heads * head_dim)
        # (batch, heads, seq, head_dim); -1 heads: all of them, or this rank's share under TP
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v) if self.attend else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff) if cfg.moe is None else MoE(cfg.d_model, cfg.moe)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 shaped decoder: embeddings, blocks, a final norm and a head (tied to the token
    embedding unless `tie_embeddings=False`).

    Made to be cut: the blocks sit in a ModuleDict keyed "0", "1", ..., so a pipeline stage
    can delete the blocks it does not own and every parameter keeps its name
    (`blocks.5.mlp.fc.weight` on every stage); a stage without the embeddings (`wte = wpe =
    None`) takes hidden states instead of token ids, and one without the head (`ln_f =
    lm_head = None`) returns hidden states."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids=None, labels=None, hidden=None, position_ids=None):
        """input_ids: (batch, seq) token ids, or hidden: (batch, seq, d_model) when this
        piece of the model has no embeddings; position_ids: (seq,) the tokens' places (default 0,
        1, ...; context parallel ranks hold others). Returns the loss if labels are given, else
        the logits (batch, seq, vocab), or hidden states if this piece has no head."""
        if self.wte is not None:
            T = input_ids.shape[1]
            if T > self.cfg.seq_len:  # (context parallelism checks the whole sequence where it cuts it)
                raise ValueError(f"sequence of {T} tokens is longer than the model's {self.cfg.seq_len}")
            pos = torch.arange(T, device=input_ids.device) if position_ids is None else position_ids
            hidden = self.wte(input_ids) + self.wpe(pos)  # (batch, seq, d_model)
        for block in self.blocks.values():
            hidden = block(hidden)
        if self.lm_head is None:
            return hidden
        logits = self.lm_head(self.ln_f(hidden))  # (batch, seq, vocab)
        if labels is None:
            return logits
        loss = loss_from_logits(logits, labels)
        return loss if self.cfg.moe is None else loss + aux_loss(self)  # MoE: plus the balancing losses


# T5 presets are the released checkpoints' configurations (Raffel et al. 2020, Table 14,
# https://arxiv.org/abs/1910.10683; the hub's config.json of t5-small ... t5-3b), dropout 0.1
# included: training one trains what the sources trained. t5-tiny is this package's test model:
# dropout 0, since parity tests compare ranks with one device and dropout draws per process.
T5_RELEASED_DROPOUT = 0.1
T5_SIZES = {
    "t5-tiny": dict(d_model=64, d_ff=256, d_kv=16, num_heads=4, num_layers=2, vocab_size=512, dropout_rate=0.0),
    "t5-small": dict(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=6, dropout_rate=T5_RELEASED_DROPOUT),
    "t5-base": dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12, dropout_rate=T5_RELEASED_DROPOUT),
    "t5-large": dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24,
                     dropout_rate=T5_RELEASED_DROPOUT),
    "t5-3b": dict(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, dropout_rate=T5_RELEASED_DROPOUT),
}

# GPT-2 sizes from Radford et al. 2019 (vocab 50257, context 1024); the small ones run on a laptop.
GPT_SIZES = {
    "gpt-tiny": GPTConfig(vocab_size=128, n_layer=2, n_head=4, d_model=64, seq_len=64),
    "gpt-mini": GPTConfig(vocab_size=512, n_layer=4, n_head=4, d_model=128, seq_len=128),
    "gpt-small": GPTConfig(vocab_size=2048, n_layer=6, n_head=8, d_model=256, seq_len=256),
    "gpt-long": GPTConfig(vocab_size=512, n_layer=2, n_head=8, d_model=128, seq_len=16384),  # for long sequences
    # mixtures of experts (moe.py): 4 and 8 experts of the dense MLP's size, 2 per token (Mixtral's k)
    "gpt-moe-tiny": GPTConfig(vocab_size=128, n_layer=2, n_head=4, d_model=64, seq_len=64, moe=MoEConfig(4)),
    "gpt-moe-small": GPTConfig(vocab_size=2048, n_layer=6, n_head=8, d_model=256, seq_len=256, moe=MoEConfig(8)),
    "gpt2": GPTConfig(vocab_size=50257, n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "gpt2-medium": GPTConfig(vocab_size=50257, n_layer=24, n_head=16, d_model=1024, seq_len=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, n_layer=36, n_head=20, d_model=1280, seq_len=1024),
    "gpt2-xl": GPTConfig(vocab_size=50257, n_layer=48, n_head=25, d_model=1600, seq_len=1024),
}

# preset -> (family, default sequence length used for training)
PRESETS = {
    **{name: ("gpt", min(cfg.seq_len, 256 if name.startswith("gpt2") else 1024)) for name, cfg in GPT_SIZES.items()},
    **{name: ("t5", 32 if name == "t5-tiny" else 256) for name in T5_SIZES},
}


def t5_config(name: str):
    from transformers import T5Config

    # a bare T5Config needs these two ids to train with `labels` (transformers 5.x)
    return T5Config(
        **{"vocab_size": 32128, **T5_SIZES[name]},
        feed_forward_proj="relu",
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,  # training: no key/value cache (it also breaks activation checkpointing)
    )


# -- models named by a Hugging Face config.json (no weights downloaded: built from the config,
# initialised from the seed): model_type "gpt2" builds the package's GPT with the file's sizes,
# "t5" a T5, anything else transformers' AutoModelForCausalLM ("causal-lm", e.g. a Llama).


class ModelConfigError(ConfigError):
    """A config.json that cannot become a model; the message says what to change."""


def read_config_file(path: str) -> dict:
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ModelConfigError(f"--model {path!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                               "config.json file")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"cannot read {path} as a Hugging Face config.json: {e}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} is not a Hugging Face config.json: it holds a JSON "
                               f"{type(config).__name__}, not an object of settings")
    if not isinstance(config.get("model_type"), str):
        raise ModelConfigError(f"{path} names no model_type; a Hugging Face config.json says which "
                               "architecture it is (e.g. \"model_type\": \"llama\")")
    from multigpu.hf import size_problem

    if size_problem(config):  # a count a model divides by (heads, layers, sizes), named before it is built
        raise ModelConfigError(f"{path}: {size_problem(config)}")
    return config


def family(name: str) -> str:
    """"gpt", "t5" or "causal-lm" (a Hugging Face decoder built from a config.json)."""
    if name in PRESETS:
        return PRESETS[name][0]
    kind = read_config_file(name)["model_type"]
    return {"gpt2": "gpt", "t5": "t5"}.get(kind, "causal-lm")


def build_from_config_file(path: str) -> tuple[nn.Module, str]:
    """(model, family) from a Hugging Face config.json; a clear error for what cannot be built."""
    config = read_config_file(path)
    kind = config["model_type"]
    try:
        if kind == "t5":
            from transformers import T5Config, T5ForConditionalGeneration

            # the file's dropout (T5Config's default, 0.1, where it names none), as released
            cfg = T5Config(**{**config, "use_cache": False,
                              "decoder_start_token_id": config.get("decoder_start_token_id", 0),
                              "pad_token_id": config.get("pad_token_id", 0)})
            return T5ForConditionalGeneration(cfg), "t5"
        if kind == "gpt2":
            # the GPT-2 architecture is the package's GPT; the sizes come from the file
            return GPT(GPTConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"],
                                 n_head=config["n_head"], d_model=config["n_embd"],
                                 seq_len=config.get("n_positions", 1024),
                                 tie_embeddings=config.get("tie_word_embeddings", True))), "gpt"
        from multigpu.hf import build_causal_lm

        model = build_causal_lm(path)
        # the package's labels are already the next tokens (as GPT's): the model must not
        # shift them again, as a Hugging Face causal LM does with its own loss
        model.loss_function = next_token_loss
        return model, "causal-lm"
    except KeyError as e:
        raise ModelConfigError(f"{path}: a {kind} config needs the setting {e.args[0]!r}") from None
    except ValueError as e:
        if type(e) is ValueError:  # GPTConfig's own checks
            raise ModelConfigError(f"{path}: cannot build a {kind} model from it: ValueError: {e}") from None
        raise
    except Exception as e:  # the config class or the model refused a value (transformers' own checks)
        raise ModelConfigError(f"{path}: cannot build a {kind} model from it: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None


def next_token_loss(logits, labels, vocab_size=None, **kwargs) -> torch.Tensor:
    """A Hugging Face model's `loss_function` for labels that are already the next tokens."""
    return loss_from_logits(logits, labels)


def check_model(name: str) -> None:
    """A preset, or a config.json this package can build (read, not built: that is cheap)."""
    if name not in PRESETS:
        family(name)


def _config_sizes(name: str) -> dict:
    """The sizes a run needs, for a preset or a config.json: vocab, positions, heads, widths."""
    if name in GPT_SIZES:
        c = GPT_SIZES[name]
        return dict(vocab=c.vocab_size, positions=c.seq_len, heads=c.n_head, kv_heads=c.n_head,
                    d_model=c.d_model, d_ff=c.d_ff)
    if name in T5_SIZES:
        c = t5_config(name)
        return dict(vocab=c.vocab_size, positions=None, heads=c.num_heads, kv_heads=c.num_heads,
                    d_model=c.d_model, d_ff=c.d_ff)
    config = read_config_file(name)
    get = lambda *keys, default=None: next((config[k] for k in keys if k in config), default)  # noqa: E731
    heads = get("num_attention_heads", "n_head", "num_heads")
    return dict(vocab=get("vocab_size"), positions=get("max_position_embeddings", "n_positions"),
                heads=heads, kv_heads=get("num_key_value_heads", default=heads),
                d_model=get("hidden_size", "n_embd", "d_model"),
                d_ff=get("intermediate_size", "n_inner", "d_ff") or 4 * (get("hidden_size", "n_embd") or 0))


def vocab_size(name: str) -> int:
    return _config_sizes(name)["vocab"]


def max_seq_len(name: str) -> int | None:
    """Longest sequence a model can take (GPT: its position table; T5: no limit)."""
    return _config_sizes(name)["positions"]


def default_seq_len(name: str) -> int:
    if name in PRESETS:
        return PRESETS[name][1]
    return min(max_seq_len(name) or 256, 256)


def tensor_parallel_problems(name: str, tp: int, seq_len: int, sequence_parallel: bool) -> list[str]:
    """What keeps `tp` ranks from splitting this model evenly (empty: nothing). Attention is
    split by heads (and GQA's key/value heads), the MLP by its hidden width, the embedding and
    the loss by the vocabulary; sequence parallelism also splits the sequence."""
    if family(name) == "t5":
        return ["tensor parallelism here takes GPT-style decoders (a preset gpt-* or a causal LM "
                "config.json), not T5"]
    size = _config_sizes(name)
    needs = [("attention heads", size["heads"]), ("key/value heads", size["kv_heads"]),
             ("MLP width", size["d_ff"]), ("vocabulary", size["vocab"])]
    if sequence_parallel:
        needs.append(("sequence length", seq_len))
    problems = list(dict.fromkeys(p for what, n in needs if n for p in split_problems(tp, n, what)))
    both = [d for d in range(1, 65) if all(n % d == 0 for _, n in needs if n)]  # what every cut takes at once
    return problems + [f"the tp values that divide all of these: {', '.join(map(str, both))}"] * (len(problems) > 1)


def split_problems(tp: int, count: int, what: str) -> list[str]:
    """[] if `tp` ranks can split `count` `what` evenly, else the one message every check of
    tensor parallelism gives (config validation, the library's and the from-scratch split)."""
    if count % tp == 0:
        return []
    fits = [d for d in range(1, count + 1) if count % d == 0 and d <= 64]
    return [f"tp {tp} does not divide the {count} {what}; use a tp that divides {count} "
            f"(e.g. {', '.join(map(str, fits[-4:]))})"]


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A preset or a config.json's model; the same seed gives the same initial weights in
    every process."""
    torch.manual_seed(seed)
    if name not in PRESETS:
        if not name.endswith(".json"):
            raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return build_from_config_file(name)[0]
    if PRESETS[name][0] == "gpt":
        return GPT(GPT_SIZES[name])
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration(t5_config(name))


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units, in order (GPT's blocks; T5's encoder then decoder blocks)."""
    types = transformer_block_types(model)
    return [m for m in model.modules() if isinstance(m, types)]


def transformer_block_types(model: nn.Module) -> tuple[type, ...]:
    """The repeated unit of a model: what checkpointing and FSDP wrap one by one."""
    if isinstance(model, GPT):
        return (Block,)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None and len(layers):  # a Hugging Face causal LM: model.model.layers
        return (type(layers[0]),)
    from transformers.models.t5.modeling_t5 import T5Block

    return (T5Block,)


def apply_activation_checkpointing(model: nn.Module, mode: bool | str = True) -> nn.Module:
    """Recompute each block's activations in backward instead of keeping them: all of them (True,
    "full") or the cheap ones ("selective"; multigpu.recompute)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as apply_ac,
    )

    from multigpu.recompute import checkpoint_wrapper_fn, mark_output_projections, recompute_mode

    if recompute_mode(mode) == "selective":
        mark_output_projections(model)
    block_types = transformer_block_types(model)
    apply_ac(model, checkpoint_wrapper_fn=checkpoint_wrapper_fn(recompute_mode(mode)),
             check_fn=lambda m: isinstance(m, block_types))
    return model


def compute_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over every label token of the batch, for either family."""
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_count(name: str) -> int:
    """Parameters of a preset, counted on the meta device (no memory allocated)."""
    with torch.device("meta"):
        return count_parameters(build_model(name))


def describe(name: str) -> str:
    n = parameter_count(name)
    return f"{name} ({n / 1e6:.1f}M parameters)" if n >= 1e6 else f"{name} ({n:,} parameters)"
