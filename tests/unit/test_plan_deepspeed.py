"""DeepSpeed in the memory plan (sft_recipe/plan/deepspeed.py): the shipped ZeRO-3 YAMLs, ZeRO-2, CPU offload of the
optimizer and the parameters, the load phases, the constants against DeepSpeed's and accelerate's own, the launcher's
environment read back as the same plan, and the fit ladder's DeepSpeed steps."""

from __future__ import annotations

import json
import logging

import pytest

from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.errors import ConfigError
from sft_recipe.plan import GIB, model_shape, parse_train_flags, plan_memory, read_accelerate_config
from sft_recipe.plan.components import base_weight_bytes, count_trainable
from sft_recipe.plan.deepspeed import (
    MASTER_AND_ADAM_BYTES,
    PERSISTENCE_THRESHOLD_ELEMENTS,
    PREFETCH_BUCKET_ELEMENTS,
    REDUCE_BUCKET_ELEMENTS,
)
from sft_recipe.plan.inputs import distribution, workload
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


def test_zero3_partitions_every_weight_and_the_optimizer_and_keeps_one_reduce_bucket(lora):
    cfg = read_accelerate_config(ZERO3_YAML)
    plan = _plan(lora, cfg)
    gpu, host = _rows(plan)
    model_args, data_args, _, training_args = lora
    w = workload(model_args, data_args, training_args, "cuda")
    shape = model_shape(LLAMA_70B, extra_vocab=w.extra_vocab)
    shardable, replicated, _ = base_weight_bytes(shape, w)
    trainable, tbytes = count_trainable(shape, w)
    assert gpu["base weights"] == pytest.approx(shardable / 8 + replicated)
    assert gpu["optimizer state"] == pytest.approx(trainable * MASTER_AND_ADAM_BYTES / 8)
    assert gpu["gradients"] == pytest.approx(trainable * tbytes / 8 + REDUCE_BUCKET_ELEMENTS * tbytes)
    assert 0 < gpu["ZeRO-3 gathered parameters"] < shape.layer_params * 2  # a module at a time, not a layer unit
    assert host["loading"] == 0  # zero3_init_flag: partitioned as it is read
    assert plan.setup.startswith("DeepSpeed ZeRO-3, 8 processes")
    # 16 ranks: the weights' share halves, the activations do not move
    sixteen = _rows(_plan(lora, {**cfg, "num_processes": 16}))[0]
    assert sixteen["base weights"] == pytest.approx(shardable / 16 + replicated)
    assert sixteen["activations: checkpoints"] == gpu["activations: checkpoints"]


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
    model_args, data_args, _, training_args = qlora
    w = workload(model_args, data_args, training_args, "cuda")
    shardable, replicated, _ = base_weight_bytes(model_shape(LLAMA_70B, extra_vocab=w.extra_vocab), w)
    assert plan.phases["load"] == pytest.approx(2.0 * GIB + shardable + replicated)
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
