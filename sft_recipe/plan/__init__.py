"""Will it fit? A per-rank memory plan for a training run, from the model's config alone.

    python -m sft_recipe.plan --config_file configs/fsdp_config.yaml --gpu_memory_gib 80 [train.py flags]
    python -m sft_recipe.plan --config_file configs/fsdp_config.yaml --gpu_memory_gib 80 \
        --config recipes/llama2_70b_lora.yaml --model_name_or_path sft_recipe/plan/models/llama-2-70b
    python -m sft_recipe.plan --fewest_gpus --gpu_memory_gib 80 --config recipes/llama2_70b_lora.yaml
    python -m sft_recipe.plan --longest_seq_len --gpu_memory_gib 24 --config_file configs/fsdp_config_qlora.yaml \
        --config recipes/llama2_70b_qlora.yaml

The planner takes the same flags and accelerate YAML as training plus the memory of one GPU, builds the model on the
meta device (its config only: no weight is downloaded, read or allocated, so a 70B costs what the tiny model costs),
and prints, per rank: base weights, LoRA/DoRA parameters, gradients, optimizer state, activations, FSDP all-gather
buffers and framework overhead; host RAM per node; a verdict (fits or not, headroom); and when it does not fit, the
cheapest changes that make it fit, in order, each with its predicted per-GPU memory. The renting questions
(renting.py) search over the same plans: the fewest GPUs of a given memory that fit (per engine, with and without
CPU offload) and the longest --max_seq_len that fits a setup (checkpointing and TRL's --activation_offloading on and
off), each answer with its plan and the `accelerate launch` command.

Notation used in every formula of this package (all sizes in bytes unless a name says otherwise):

    P      parameters of the base model;  Q  of them in the linear layers bitsandbytes quantizes (every nn.Linear but
           the output head);  L  decoder layers;  h  hidden size;  i  MLP width;  kv = key/value heads x head_dim;
           V  vocabulary (rows of the output head)
    N      processes (ranks);  n  ranks per machine;  G  ranks a parameter is sharded over
           (FULL_SHARD / SHARD_GRAD_OP / FSDP2: N;  HYBRID_SHARD: n;  NO_SHARD, DDP, one process: 1)
    b      bytes per base weight as loaded (--torch_dtype): 2 for LoRA under --bf16 True (the recipe's default), 4
           with --torch_dtype float32 (upstream's load) or without bf16; the 4-bit storage dtype's size (QLoRA under
           FSDP loads the model in --bnb_4bit_quant_storage_dtype)
    a      bytes per activation element: 2 with bf16/fp16 (mixed precision or a bf16 model), else 4
    B, S   micro-batch (--per_device_train_batch_size) and sequence length (--max_length); T = B x S tokens per
           step (packing fills rows to S; without packing S is the worst case, the longest row)
    r      LoRA rank;  m  adapted linear layers per decoder layer;  D  sum of their input widths
    U      parameters of one FSDP unit: a decoder layer (TRANSFORMER_BASED_WRAP wraps each), or the root unit
           (embeddings, final norm, output head)

Each formula is in the docstring of the function computing it (components.py, gpu.py, cpu.py).
Everything here was measured against this stack (torch 2.13, transformers 5.24, trl 1.16, peft 0.21,
bitsandbytes 0.50): activation coefficients against autograd's saved tensors of a real model
(tests/unit/test_plan.py), the loss's terms against what its ops allocate (tests/unit/test_plan_loss.py), CPU peak
RSS against real `accelerate launch` runs (bench/memory_plan.py). A GPU plan's rows are what
`torch.cuda.max_memory_allocated` counts, then the caching allocator's reserve (`allocator reserve`: reserved beyond
allocated) and what nvidia-smi shows beyond torch (`framework overhead`); those two are set against 24 GPU figures
others published (tests/published_gpu_memory.csv, bench/plan_vs_published.py), and a GPU verdict "fits" only with
the plan's worst miss there as headroom (result.GPU_PLAN_ERROR_BELOW), "tight" inside it.

Where the published figures of the guide's two runs come from: PEFT's "Use PEFT and FSDP" guide (72-80 GB/GPU for
LoRA on 8x80 GB; QLoRA on 2x24 GB: 19.6 GB/GPU with CPU offload and ~107 GB host RAM, 35.6 GB/GPU without). The
Llama-2-70B config in sft_recipe/plan/models/llama-2-70b is written from the published architecture (see its
README.txt).

The modules, in the order a plan is made:

    shape.py       the architecture, counted on the meta device (ModelShape)
    inputs.py      the run: accelerate YAML -> Distribution (how it is spread), train.py flags -> Workload
    components.py  the formulas both estimates share: weights, adapter, optimizer state, activations, FSDP buffers
    gpu.py         GPU memory per rank and host RAM per machine of a CUDA run (one process, DDP, FSDP)
    deepspeed.py   the same for DeepSpeed ZeRO-2 / ZeRO-3, with and without CPU offload
    cpu.py         peak RSS per rank of a CPU run (constants measured on this stack)
    result.py      MemoryPlan, its rows, and how it prints
    planner.py     plan_memory, and the fit ladder when a run does not fit
    renting.py     the fewest GPUs that fit, the longest --max_seq_len that fits (--fewest_gpus, --longest_seq_len)
    guide_renting.py  those answers for the guide's runs (--guide)
    guide.py       the guide's runs, predicted vs published (--guide)
    cli.py         the command line (__main__.py runs it)
"""

from sft_recipe.plan.cli import main
from sft_recipe.plan.components import activation_bytes_per_token_per_layer, adapter_bytes
from sft_recipe.plan.components import base_weight_bytes as _base_weight_bytes  # bench/scale.py's name for it
from sft_recipe.plan.guide import PUBLISHED, guide_plans, render_guide_comparison
from sft_recipe.plan.inputs import Distribution, Workload, parse_train_flags, read_accelerate_config, workload
from sft_recipe.plan.planner import fit_ladder, plan_memory
from sft_recipe.plan.renting import Answer, fewest_gpus, longest_seq_len, run_from_flags
from sft_recipe.plan.result import GIB, MIB, MemoryPlan
from sft_recipe.plan.shape import ModelShape, model_shape

# What code outside the package imports (train.py, bench/, tests/); everything else is imported from its module.
__all__ = [
    "GIB",
    "MIB",
    "PUBLISHED",
    "Distribution",
    "MemoryPlan",
    "ModelShape",
    "Workload",
    "Answer",
    "_base_weight_bytes",
    "activation_bytes_per_token_per_layer",
    "adapter_bytes",
    "fewest_gpus",
    "fit_ladder",
    "guide_plans",
    "longest_seq_len",
    "main",
    "model_shape",
    "parse_train_flags",
    "plan_memory",
    "read_accelerate_config",
    "render_guide_comparison",
    "run_from_flags",
    "workload",
]
