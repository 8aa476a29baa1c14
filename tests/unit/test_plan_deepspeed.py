"""DeepSpeed in the memory plan (sft_recipe/plan/deepspeed.py): the shipped ZeRO-3 YAMLs, ZeRO-2, CPU offload of the
optimizer and the parameters, the load phases, the constants against DeepSpeed's and accelerate's own, the launcher's
environment read back as the same plan, and the fit ladder's DeepSpeed steps."""

from __future__ import annotations

import json
import logging

import pytest

from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.errors import ConfigError
from sft_recipe.plan import GIB, parse_train_flags, plan_memory, read_accelerate_config
from sft_recipe.plan.deepspeed import (
    PERSISTENCE_THRESHOLD_ELEMENTS,
    PREFETCH_BUCKET_ELEMENTS,
    REDUCE_BUCKET_ELEMENTS,
)
from sft_recipe.plan.inputs import distribution
from tests.helpers import REPO

LLAMA_70B = str(REPO / "sft_recipe" / "plan" / "models" / "llama-2-70b")
ZERO3_YAML = REPO / "configs" / "deepspeed_config.yaml"
ZERO3_QLORA_YAML = REPO / "configs" / "deepspeed_config_z3_qlora.yaml"


def _args(recipe: str):
    return parse_train_flags(["--config", str(REPO / "recipes" / recipe), "--model_name_or_path", LLAMA_70B], "cuda")


@pytest.fixture(scope="module")
def lora():
    return _args("llama2_70b_lora.yaml")


@pytest.fixture(scope="module")
def qlora():
    return _args("llama2_70b_qlora.yaml")


def _plan(args, cfg, gpu_gib=80.0, **kw):
    model_args, data_args, _, training_args = args
    return plan_memory(model_args, data_args, training_args, cfg, None, gpu_gib, "cuda", **kw)


def _rows(plan):
    return {r.name: r.bytes for r in plan.rows}, {r.name: r.bytes for r in plan.host_rows}


def _with(cfg: dict, **deepspeed) -> dict:
    return {**cfg, "deepspeed_config": {**cfg["deepspeed_config"], **deepspeed}}


def test_deepspeeds_defaults_are_the_plans_and_accelerate_sets_no_bucket_size():
    """accelerate builds DeepSpeed's config from the YAML's keys alone, so DeepSpeed's defaults size the buffers."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = DeepSpeedZeroConfig()
    assert (defaults.reduce_bucket_size, defaults.prefetch_bucket_size, defaults.param_persistence_threshold) == (
        REDUCE_BUCKET_ELEMENTS, PREFETCH_BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD_ELEMENTS)
    built = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="none", offload_param_device="none",
                            zero3_init_flag=True).deepspeed_config["zero_optimization"]
    assert not {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"} & set(built)


# Hand-computed from Llama-2-70B's config.json (hidden 8192, MLP 28672, 80 layers, 8 KV heads of 128, vocab 32000)
# plus the 3 rows chatml adds (recipes/llama2_70b_lora.yaml), independent of the planner's code:
# per layer 2 x 8192^2 (q, o) + 2 x 8192 x 1024 (k, v) + 3 x 8192 x 28672 (MLP) = 855,638,016; x 80 = 68,451,041,280;
# embeddings and head 2 x 32,003 x 8192 = 524,337,152; 161 norms of 8192 = 1,318,912: 68,976,697,344 parameters,
# 2 bytes each in bf16 (the published 68,976,648,192 without chatml's rows).
BASE_BYTES_70B = 68_976_697_344 * 2
# LoRA r=8 on every linear, 8 x (in + out) each: 80 x 8 x (2 x 16,384 + 2 x 9,216 + 3 x 36,864) = 103,546,880 (PEFT's
# "trainable params" for this model); fp32 (PEFT keeps adapters in fp32 over a bf16 base).
LORA_PARAMS_70B = 103_546_880
ZERO_REDUCE_BUCKET = 500_000_000  # DeepSpeedZeroConfig().reduce_bucket_size (pinned by the test above)


def test_zero3_partitions_every_weight_and_the_optimizer_and_keeps_one_reduce_bucket(lora):
    cfg = read_accelerate_config(ZERO3_YAML)
    plan = _plan(lora, cfg)
    gpu, host = _rows(plan)
    assert gpu["base weights"] == pytest.approx(BASE_BYTES_70B / 8, rel=1e-3)  # 8 ranks, each its eighth
    assert gpu["LoRA/DoRA params"] == pytest.approx(LORA_PARAMS_70B * 4 / 8)
    # fp32 master copy + Adam's two moments: 12 bytes a trainable parameter, partitioned
    assert gpu["optimizer state"] == pytest.approx(LORA_PARAMS_70B * 12 / 8)
    # fp32 gradients, partitioned, plus one reduce bucket of fp32 elements
    assert gpu["gradients"] == pytest.approx(LORA_PARAMS_70B * 4 / 8 + ZERO_REDUCE_BUCKET * 4)
    layer_bytes = 855_638_016 * 2
    assert 0 < gpu["ZeRO-3 gathered parameters"] < layer_bytes  # a module at a time, not a layer unit
    assert host["loading"] == 0  # zero3_init_flag: partitioned as it is read
    assert plan.setup.startswith("DeepSpeed ZeRO-3, 8 processes")
    # 16 ranks: the weights' share halves, the activations do not move
    sixteen = _rows(_plan(lora, {**cfg, "num_processes": 16}))[0]
    assert sixteen["base weights"] == pytest.approx(BASE_BYTES_70B / 16, rel=1e-3)
    assert sixteen["activations: checkpoints"] == gpu["activations: checkpoints"]


def test_deepspeeds_dtype_not_torch_dtype_sizes_the_base():
    """PEFT's DeepSpeed guide loads the 70B with --torch_dtype float32 beside --bf16 True: zero.Init makes every
    weight bf16 as it is created (tests/test_deepspeed.py pins DeepSpeed doing so), so the base is 2 bytes a weight
    on the GPUs, as with --torch_dtype bfloat16; without mixed precision it stays fp32."""
    def base(*flags):
        args = parse_train_flags(["--config", str(REPO / "recipes" / "llama2_70b_lora.yaml"), "--model_name_or_path",
                                  LLAMA_70B, *flags], "cuda")
        return _rows(_plan(args, read_accelerate_config(ZERO3_YAML)))[0]["base weights"]

    assert base("--torch_dtype", "float32") == pytest.approx(BASE_BYTES_70B / 8, rel=1e-3)
    assert base("--torch_dtype", "bfloat16") == pytest.approx(BASE_BYTES_70B / 8, rel=1e-3)
    assert base("--torch_dtype", "float32", "--bf16", "False") == pytest.approx(BASE_BYTES_70B * 2 / 8, rel=1e-3)


def test_cpu_offload_moves_the_optimizer_and_the_parameters_to_host_ram(lora):
    cfg = read_accelerate_config(ZERO3_YAML)
    on_gpu, _ = _rows(_plan(lora, cfg))
    offloaded = _plan(lora, _with(cfg, offload_optimizer_device="cpu", offload_param_device="cpu"))
    gpu, host = _rows(offloaded)
    assert gpu["base weights"] < on_gpu["base weights"] / 100 and gpu["optimizer state"] == 0
    assert host["offloaded parameters"] == pytest.approx(on_gpu["base weights"] * 8, rel=0.01)  # n/N = 1
    assert host["offloaded optimizer"] > 0
    assert "CPU offload of parameters, optimizer" in offloaded.setup


def test_zero2_keeps_the_whole_model_on_every_gpu_and_loads_a_copy_per_process(lora):
    cfg = _with(read_accelerate_config(ZERO3_YAML), zero_stage=2)
    zero2, zero3 = _plan(lora, cfg), _plan(lora, read_accelerate_config(ZERO3_YAML))
    assert _rows(zero2)[0]["base weights"] == pytest.approx(_rows(zero3)[0]["base weights"] * 8, rel=0.01)
    assert _rows(zero2)[1]["loading"] > 0 and "ZeRO-3 gathered parameters" not in _rows(zero2)[0]
    assert zero2.verdict == "does not fit" and zero2.fails_at == "wrap"  # moved whole before it is partitioned
    steps = zero2.ladder
    assert steps and steps[0].change == "ZeRO-3" and "--zero_stage 3" in steps[0].how


def test_qlora_under_zero3_loads_the_whole_4bit_base_on_every_gpu(qlora):
    plan = _plan(qlora, read_accelerate_config(ZERO3_QLORA_YAML), gpu_gib=24.0, ladder=False)
    # NF4 packs two weights a byte (stored as bf16 elements); nested quantization keeps an 8-bit absmax per block of
    # 64 weights (0.125 bits a weight) and an fp32 constant per 256 blocks (0.002 bits): ~0.127 bits a weight. The
    # linears (68,451,041,280 weights, above) at ~0.516 bytes each are ~35.3e9 bytes; the embeddings, head and norms
    # stay bf16: (524,337,152 + 1,318,912) x 2 = 1.05e9. Every rank loads all of it, on top of the 2 GiB CUDA context.
    four_bit = 68_451_041_280 * (0.5 + 0.127 / 8) + 525_656_064 * 2
    assert plan.phases["load"] == pytest.approx(2.0 * GIB + four_bit, rel=0.02)
    assert plan.phases["train step"] < plan.phases["load"] and plan.fails_at == "load"


def test_the_launchers_environment_plans_as_the_yaml_does(lora, monkeypatch):
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
           "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8",
           "ACCELERATE_MIXED_PRECISION": "bf16"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from sft_recipe.config.launch_env import read_launch_env

    launch = read_launch_env()
    assert isinstance(launch, LaunchEnv) and launch.deepspeed_offload_param_device == "cpu"
    yaml_cfg = _with(read_accelerate_config(ZERO3_YAML), offload_optimizer_device="cpu", offload_param_device="cpu")
    assert _plan(lora, launch.accelerate_config()).peak_bytes == pytest.approx(_plan(lora, yaml_cfg).peak_bytes)


def test_a_deepspeed_config_file_is_read_and_what_is_not_planned_is_refused(lora, tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    d = distribution({"distributed_type": "DEEPSPEED", "num_processes": 4,
                      "deepspeed_config": {"deepspeed_config_file": str(path)}})
    assert (d.kind, d.zero_stage, d.offload_optimizer, d.offload) == ("deepspeed", 3, True, False)
    with pytest.raises(ConfigError, match="zero_stage 1"):
        distribution({"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {"zero_stage": 1}})
    model_args, data_args, _, training_args = lora
    with pytest.raises(ConfigError, match="DeepSpeed on a CPU run"):
        plan_memory(model_args, data_args, training_args, read_accelerate_config(ZERO3_YAML), None, 80.0, "cpu")
    with caplog.at_level(logging.WARNING):
        training_args.activation_offloading = True
        try:
            with pytest.raises(ConfigError, match="--activation_offloading True under DeepSpeed"):
                _plan(lora, read_accelerate_config(ZERO3_YAML))
        finally:
            training_args.activation_offloading = False
