"""What the sources measured, in one place with the setting they measured it in, so that the
chapters set the book's own answers beside them (their numbers are never typed into prose).

The sources are the tutorials this book grew from (the chapter "Choosing a strategy" names
what each measured); their numbers are quoted, not re-measured here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LargestBatch:
    """One row of the sources' T5 table: the largest global batch that trained."""

    model: str
    strategy: str  # the estimator's name for what the source ran
    gpus: int
    batch: int  # the global batch; 0: not even one sample
    says: str  # "largest": the largest that fitted; "fits": a batch that fitted, no larger one tried


# T5 as released (pretrained checkpoints: dropout 0.1; the attention transformers ran in 2022,
# eager), fp32, SGD with momentum (lr 0.01, momentum 0.9), random token ids 256 in and 256 out,
# V100s (32 GB: inferred, the sources say V100 only; their batches fit only the 32 GB card),
# torch 1.12; FSDP auto-wraps every T5Block
T5_SETTING = dict(seq_len=256, target_len=256, dtype="fp32", optimizer="sgd-momentum", attention="eager",
                  dropout=True)
T5_GPU = "v100-32gb"
T5_TORCH = "1.12"
T5_LARGEST_BATCH = (
    LargestBatch("t5-large", "single", 1, 14, "largest"),
    LargestBatch("t5-large", "dp", 4, 36, "largest"),
    LargestBatch("t5-large", "ddp", 4, 48, "largest"),
    LargestBatch("t5-large", "fsdp", 4, 64, "largest"),
    LargestBatch("t5-3b", "dp", 4, 0, "largest"),
    LargestBatch("t5-3b", "ddp", 4, 0, "largest"),
    LargestBatch("t5-3b", "fsdp", 4, 8, "fits"),
)

# what the book calls agreeing with a source's number: within 15% of it
AGREES = 0.15

# one epoch of a ResNet image classifier with DDP, 128 samples per process: GPUs -> seconds
RESNET_DDP_EPOCH_S = {1: 128.84, 2: 66.5, 4: 37.8}

# the machine of the best-strategy chart the sources cite (by model size and batch): a name of
# multigpu.estimator.machines.MACHINES
STRATEGY_CHART_MACHINE = "8xa100-nvlink"


@dataclass(frozen=True)
class PublishedMoE:
    """A released mixture of experts: the sizes of its config.json (Hugging Face hub), and the
    parameter counts its authors published (billions)."""

    name: str
    config: dict
    total_b: float
    active_b: float
    source: str


MIXTRAL_8X7B = PublishedMoE(
    "Mixtral 8x7B",
    {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
     "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
     "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": False},
    46.7, 12.9, "Mistral AI, \"Mixtral of experts\" (2023-12-11); Jiang et al. 2024, arXiv:2401.04088; the config.json "
                "of mistralai/Mixtral-8x7B-v0.1")
DEEPSEEK_V3 = PublishedMoE(
    "DeepSeek-V3",
    {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
     "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128,
     "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
     "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
     "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False},
    671, 37, "DeepSeek-AI 2024, DeepSeek-V3 Technical Report, arXiv:2412.19437 (the main model; its multi-token "
             "prediction module adds 14B); the config.json of deepseek-ai/DeepSeek-V3")
# how DeepSeek-V3 was trained (the report's section 3.2): 2048 H800 GPUs, 16-way pipeline, 64-way expert
# parallelism over 8 nodes, ZeRO-1 data parallelism, each token sent to at most 4 nodes
DEEPSEEK_V3_TRAINING = {"gpus": 2048, "gpu": "H800", "pp": 16, "ep": 64, "ep_nodes": 8, "dp_sharding": "ZeRO-1",
                        "nodes_per_token": 4}


@dataclass(frozen=True)
class Interruptions:
    """A published count of a training run's interruptions: how often a job on many GPUs stops."""

    run: str
    gpus: int
    days: float
    interruptions: int  # all of them, planned (maintenance) and unexpected (failures)
    unexpected: int
    checkpoint_per_gpu_bytes: tuple[float, float]  # the smallest and largest state a GPU saves
    effective_training_time: float  # the share of the time that trained, at least
    source: str


# Llama 3 405B's pretraining: a 54-day snapshot on up to 16K H100s (the paper's section 3.3.4 and Table 5)
LLAMA3_405B_INTERRUPTIONS = Interruptions(
    "Llama 3 405B pretraining", 16384, 54, 466, 419, (1e6, 4e9), 0.90,
    "Llama Team, AI @ Meta 2024, The Llama 3 Herd of Models, arXiv:2407.21783, section 3.3.4 (\"During a 54-day "
    "snapshot period of pre-training, we experienced a total of 466 job interruptions ... 419 were unexpected\"; "
    "checkpoints \"ranging from 1 MB to 4 GB per GPU\"; \"higher than 90% effective training time\")")


# torchtitan's benchmarks of December 2024 (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, run at
# torchtitan 9dec370): H100s of 96 GB HBM2e (not the 80 GB card) at the default 500 W power limit, every table with
# torch.compile, Float8 linears and full activation checkpointing
TORCHTITAN_BENCHMARK = {"gpu": "H100", "gpu_memory_gb": 96, "power_w": 500,
                        "settings": "torch.compile, Float8 linears and full activation checkpointing",
                        "source": "pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (read at b5bcd76 "
                                  "and 31a17bf)"}
# its table 2: Llama 3.1 8B on 8 GPUs, FSDP x CP, one sequence per FSDP rank (local batch 1), the sequence growing
# with cp; each row (fsdp, cp, sequence, tokens/s per GPU, memory GiB)
TORCHTITAN_8B_CP = {"rows": ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0),
                             (1, 8, 262144, 548, 84.5)),
                    "source": TORCHTITAN_BENCHMARK["source"] + ", table 2: Llama 3.1 8B, FSDP + CP on 8 H100s"}
# its table 4: Llama 3 70B on 256 GPUs with FSDP 32 x TP 8, the peak memory per GPU (without and with asynchronous
# TP), 16 sequences per data-parallel rank (global batch 512); its tensor parallelism (torchtitan 9dec370,
# parallelize_llama.py) is sequence parallel in the norms, with loss parallelism
TORCHTITAN_70B_2D = {"gpus": 256, "fsdp": 32, "tp": 8, "peak_gib": 71.9, "peak_gib_async_tp": 67.6,
                     "local_batch": 16, "global_batch": 512, "sequence_parallel": True,
                     "source": TORCHTITAN_BENCHMARK["source"] + ", table 4: Llama 3 70B, 2D on 256 H100s"}


@dataclass(frozen=True)
class Achieved:
    """A published share of a machine's limit: a matmul's measured peak against the datasheet's (MAMF), or a
    training run's MFU (its model FLOPs per second over its GPUs' datasheet peak)."""

    what: str
    achieved: float  # the share of the datasheet's dense peak
    hardware: str
    source: str


# the ML Engineering book's maximum achievable matmul FLOPS (bf16), measured by its mamf-finder against the
# datasheet: compute/accelerator/README.md (read at 744d01e)
MAMF = tuple(Achieved("matmul, bf16 (MAMF)", measured / sheet, gpu,
                      f"Bekman, Machine Learning Engineering: {measured:g} of {sheet:g} TFLOPS")
             for gpu, measured, sheet in (("A100 SXM", 271.2, 312), ("H100 SXM", 794.5, 989), ("B200", 1745, 2250),
                                          ("MI300X", 668.4, 1300)))
# training runs' MFU as their authors report it (each against the datasheet's bf16 dense peak)
PUBLISHED_MFU = (
    Achieved("SmolLM-1.7B, 3D parallel (picotron)", 0.50, "8 H100", "picotron README: \"nearly 50% MFU\""),
    Achieved("LLaMA-2-7B, 3D parallel (picotron)", 0.38, "64 H100", "picotron README: \"38% MFU\""),
    Achieved("Llama 3.1 8B, FSDP (torchtitan)", 0.33, "8-128 H100", "torchtitan, Liang et al. 2024: \"33% to 39% MFU\" "
             "(the lower end)"),
    Achieved("Llama 3 405B, TP8 PP16 DP128", 0.41, "16,384 H100", "Llama 3 Herd of Models, Table 4: 400 TFLOPs/GPU, "
             "41% BF16 MFU on 16,384 GPUs (TP 8, CP 1, PP 16, DP 128; 8,192-token sequences)"),
    Achieved("530B, TP and sequence parallel, selective recomputation", 0.542, "2,240 A100",
             "Korthikanti et al. 2022: 54.2% (42.1% with full recomputation)"),
)


@dataclass(frozen=True)
class RecomputeTrade:
    """A published cost of activation recomputation: the share of the activations it saves and the compute it
    adds (None where the source gives none)."""

    what: str
    memory_saved: float | None
    extra_compute: float | None  # the compute it adds, or the low end of a published range
    source: str
    extra_compute_high: float | None = None  # the high end, where the source gives a range


PUBLISHED_RECOMPUTATION = (
    RecomputeTrade("selective (attention's scores), GPT-3 175B", 0.70, 0.027,
                   "Ultra-Scale Playbook, after Korthikanti et al. 2022: \"activation memory -70% for +2.7% compute\""),
    RecomputeTrade("full", None, 0.30, "Ultra-Scale Playbook: full recomputation costs \"30-40%\" more compute",
                   extra_compute_high=0.40),
)
