"""A Hugging Face causal language model built from its config.json alone: random weights,
no download.

    model = build_causal_lm("path/to/config.json")   # or the folder that holds it

The architecture (layers, heads, grouped-query attention, the tensor-parallel plan) is
all in the config; a checkpoint's weights would only add the trained values, which a
lesson on parallelism does not need. For exact parity tests the model is built in fp32,
with every dropout at 0 and no key/value cache (training needs none).

The package's data for decoder models already gives `labels` as the next tokens
(labels[t] = input_ids[t + 1]), so the loss is cross-entropy of the logits against the
labels as they are: handing `labels` to a Hugging Face model would shift them once more.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.loss import loss_from_logits

# A small Llama: grouped-query attention (4 query heads share 2 key/value heads), RMSNorm,
# rotary positions, a gated MLP; untied head. 2 and 4 divide every count tensor
# parallelism cuts (heads, key/value heads, MLP units, vocabulary).
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "use_cache": False,
}


# A small Mixtral: the tiny Llama with every MLP a sparse block of 4 experts, 2 per token (its
# routing as moe.MoE's without a capacity; strategies/deepspeed_moe.py cuts its experts over ranks)
TINY_MIXTRAL = {**TINY_LLAMA, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0}


def write_tiny_llama_config(path: str | Path, config: dict = TINY_LLAMA) -> Path:
    """Write TINY_LLAMA (or `config`, e.g. TINY_MIXTRAL) as a config.json at `path` (a file, or a
    folder to put it in)."""
    path = Path(path)
    if path.suffix != ".json":
        path = path / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def config_file(config_path: str | Path) -> Path:
    """The config.json itself, given the file or the folder that holds it."""
    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no model config at {path}; give a config.json (or its folder), "
                          "e.g. one written by multigpu.hf.write_tiny_llama_config")
    return path


def load_config(config_path: str | Path):
    """The transformers config for a config.json, read from disk only."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = config_file(config_path)
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); fix the file or write a fresh one "
                          "with multigpu.hf.write_tiny_llama_config") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} holds a JSON {type(values).__name__}, not an object of config fields")
    model_type = values.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{path} has model_type {model_type!r}, which transformers does not know; "
                          "set model_type to an architecture such as 'llama', 'qwen2' or 'mistral'")
    values.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **values)


# the counts and sizes of a config.json that a model is built from (and divides by): each a whole number >= 1
SIZE_SETTINGS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "num_local_experts",
                 "num_experts_per_tok", "n_embd", "n_layer", "n_head", "n_positions", "d_model", "d_ff", "d_kv",
                 "num_layers", "num_decoder_layers", "num_heads")


def size_problem(config: dict) -> str | None:
    """What is wrong with the first count or size in `config` that is not a whole number >= 1 (None: nothing)."""
    for name in SIZE_SETTINGS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"the setting {name!r} is {value!r}; it must be a whole number >= 1 (a count or a size)"
    return None


def build_causal_lm(config_path: str | Path, seed: int = 0) -> nn.Module:
    """AutoModelForCausalLM from a config.json, random weights from `seed`, in the default dtype (fp32), no
    dropout, no cache. The same seed gives the same weights in every process."""
    from transformers import AutoModelForCausalLM

    config = load_config(config_path)
    for name, value in config.to_dict().items():  # attention_dropout, hidden_dropout, resid_pdrop, ...
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            setattr(config, name, 0.0)
    config.use_cache = False
    torch.manual_seed(seed)
    default = torch.get_default_dtype()  # fp32 to train; bf16 where the estimator traces a model's bf16 weights
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=default)
    except ValueError as err:  # e.g. an encoder-only or encoder-decoder architecture
        raise ConfigError(f"{config_file(config_path)}: model_type {config.model_type!r} is not a causal "
                          f"language model transformers can build ({str(err).splitlines()[0]}); "
                          "use a decoder such as 'llama'") from None
    # already in the default dtype (from_config's), kept as it is: a dry run's fake weights cannot be swapped
    return model if all(p.dtype == default for p in model.parameters()) else model.to(default)


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross-entropy of a causal LM on the package's batches (labels already shifted)."""
    return loss_from_logits(model(input_ids=batch["input_ids"]).logits, batch["labels"])


def set_attention(model: nn.Module, attention: str) -> None:
    """Make every attention layer of a Hugging Face model compute `attention` ("sdpa" or
    "eager"), and check that it took. `set_attn_implementation` on the whole model is
    transformers' own switch, but before 5.23 it skips sub-models of the model's own config
    class: T5's encoder and decoder keep copies of the config, and stayed on SDPA under
    transformers 5.17 (seen on a GPU machine: "eager" and "sdpa" runs held the same bytes).
    So every sub-model is switched too, and a layer left on another implementation is an
    error rather than a mislabelled measurement."""
    from transformers import PreTrainedModel

    model.set_attn_implementation(attention)
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and sub.config._attn_implementation != attention:
            sub.set_attn_implementation(attention)
    left = {type(m).__name__: m.config._attn_implementation for m in model.modules()
            if getattr(getattr(m, "config", None), "_attn_implementation", attention) != attention}
    if left:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} left {left} on another attention than "
                           f"{attention!r}: the run would not compute what it says")


__all__ = ["TINY_LLAMA", "build_causal_lm", "hf_loss", "load_config", "set_attention", "write_tiny_llama_config"]


def counted_on_meta(config: dict) -> dict[str, int]:
    """A causal LM built by transformers from a config dict on the meta device (no memory, no
    weights): its parameters, and those of its routed experts (tensors under an `experts` module)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings))
    named = dict(model.named_parameters())
    return {"parameters": sum(p.numel() for p in named.values()),
            "expert_parameters": sum(p.numel() for name, p in named.items() if ".experts." in name)}


# -- leaving the package: the package's GPT as transformers' GPT-2 ----------------------------------------

_GPT2_BLOCK = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}  # GPT-2's Conv1D holds its weight (in, out)


def gpt2_config(cfg) -> dict:
    """transformers' GPT2Config (as a dict) of the package's GPT with config `cfg` (models.GPTConfig): the same
    sizes, exact GELU (the package's F.gelu; GPT-2's own is the tanh approximation, "gelu_new"), no dropout."""
    if cfg.moe is not None:
        raise ConfigError("a mixture of experts has no GPT-2 counterpart in transformers; export a dense GPT")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": cfg.d_ff, "activation_function": "gelu", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": None,
            "eos_token_id": None}


def gpt2_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The package GPT's weights under GPT2LMHeadModel's names (`blocks.3.attn.qkv.weight` ->
    `transformer.h.3.attn.c_attn.weight`, transposed: GPT-2's Conv1D multiplies x @ W)."""
    out = {}
    for name, value in state.items():
        if name == "lm_head.weight" or not name.startswith("blocks."):
            out[name if name == "lm_head.weight" else f"transformer.{name}"] = value
            continue
        _, i, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        hf = _GPT2_BLOCK[module]
        out[f"transformer.h.{i}.{hf}.{leaf}"] = value.t().contiguous() if hf in _CONV1D and leaf == "weight" else value
    return out

