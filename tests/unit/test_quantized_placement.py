"""Where a quantized base is put while loading (compat.quantized_base_device_map), decided without a GPU.

transformers 5.24 maps a bitsandbytes-quantized base whole onto each rank's GPU (and warms the allocator up to its
size there) unless told otherwise; under FSDP the recipe tells it the CPU, and FSDP moves the packed weights to the
GPU one unit at a time. A CPU cannot show CUDA placement, so these tests pin the decision and what transformers would
do without it (with CUDA simulated); bench/gpu_check.sh measures the GPU memory it leads to.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sft_recipe.compat import quantized_base_device_map
from sft_recipe.compat.quantized_load import CPU_DEVICE_MAP
from sft_recipe.config.args import ModelArguments
from sft_recipe.config.launch_env import LaunchEnv
from sft_recipe.train import model as model_module
from sft_recipe.train.load_plan import decide_load
from sft_recipe.train.model import bnb_config, quantization_threads
from tests.recording_device import RecordingDevice

FSDP1 = LaunchEnv(rank=1, local_rank=1, world_size=2, use_fsdp=True, fsdp_version=1,
                  fsdp_cpu_ram_efficient_loading=True, fsdp_sync_module_states=True)
FSDP1_PER_RANK = LaunchEnv(rank=1, local_rank=1, world_size=2, use_fsdp=True, fsdp_version=1)
FSDP1_RANK0 = LaunchEnv(**{**vars(FSDP1), "rank": 0, "local_rank": 0})
FSDP2 = LaunchEnv(rank=1, local_rank=1, world_size=2, use_fsdp=True, fsdp_version=2,
                  fsdp_cpu_ram_efficient_loading=True)
DDP = LaunchEnv(rank=1, local_rank=1, world_size=2)
ONE_PROCESS = LaunchEnv()


def qlora_args(path: str = "unused", **overrides) -> ModelArguments:
    values = dict(model_name_or_path=path, use_peft_lora=True, use_4bit_quantization=True, use_nested_quant=True,
                  bnb_4bit_quant_storage_dtype="bfloat16", bnb_4bit_compute_dtype="float32")
    return ModelArguments(**{**values, **overrides})


@pytest.mark.parametrize("launch", [FSDP1, FSDP2], ids=["fsdp1", "fsdp2"])
def test_fsdp_loads_a_quantized_base_on_the_cpu(launch):
    assert quantized_base_device_map(qlora_args(), launch) == {"": "cpu"}
    # Every rank decides the same, whatever its rank, so every rank quantizes the same bytes.
    assert quantized_base_device_map(qlora_args(), LaunchEnv(**{**vars(launch), "rank": 0, "local_rank": 0})) == \
        {"": "cpu"}


@pytest.mark.parametrize("launch", [DDP, ONE_PROCESS], ids=["ddp", "one-process"])
def test_one_process_and_ddp_keep_the_quantizers_placement(launch):
    """There the whole model trains on each GPU: the quantizer's own map (this rank's GPU) is the right one."""
    assert quantized_base_device_map(qlora_args(), launch) is None


def test_an_unquantized_base_gets_no_device_map():
    assert quantized_base_device_map(ModelArguments(model_name_or_path="x", use_peft_lora=True), FSDP1) is None


def _simulate_cuda(monkeypatch, device_index: int = 3) -> list:
    """torch says a GPU with 139 GiB free is there (current device `device_index`); allocations on it are recorded
    (bytes) instead of made. Returns the record."""
    import bitsandbytes  # noqa: F401  imported for the real machine: it picks its backends by CUDA availability

    allocated = []
    real_empty = torch.empty

    def empty(*size, device=None, dtype=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            allocated.append(int(torch.tensor(shape).prod()) * real_empty((), dtype=dtype).element_size())
            return real_empty(0, dtype=dtype)
        return real_empty(*size, device=device, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device_index)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (139 * 2**30, 139 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: 0)
    monkeypatch.setattr(torch, "empty", empty)
    return allocated


def test_transformers_still_loads_a_quantized_base_onto_the_gpu(monkeypatch, quantized_tiny, tiny):
    """What transformers 5.24 does without the recipe's map, with CUDA simulated: the quantizer maps the whole base
    to this rank's GPU and the loader warms that GPU's allocator up to the quantized size. When this fails, the
    library places quantized bases itself again and compat.quantized_base_device_map can go."""
    from transformers.modeling_utils import caching_allocator_warmup, expand_device_map
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from sft_recipe.model.shape import meta_model

    quantized_bytes = sum(p.numel() * p.element_size() for p in quantized_tiny.parameters())
    quantizer = Bnb4BitHfQuantizer(bnb_config(qlora_args()))
    allocated = _simulate_cuda(monkeypatch)
    assert quantizer.update_device_map(None) == {"": 3}  # the whole base on GPU 3
    assert quantizer.update_device_map(dict(CPU_DEVICE_MAP)) == CPU_DEVICE_MAP  # an explicit map is kept

    model = meta_model(str(tiny.model_dir))
    keys = list(model.state_dict())
    gpu_map = {"": "cuda:3"}  # the quantizer's map as a device name (a CPU build of torch cannot parse a bare index)
    caching_allocator_warmup(model, expand_device_map(gpu_map, keys), quantizer)
    assert len(allocated) == 1 and allocated[0] >= 0.9 * quantized_bytes  # the whole quantized base, at once
    caching_allocator_warmup(model, expand_device_map(dict(CPU_DEVICE_MAP), keys), quantizer)  # ours: nothing
    assert len(allocated) == 1


class _Stop(Exception):
    pass


FSDP2_CPU_RUN = LaunchEnv(**{**vars(FSDP2), "use_cpu": True})
FSDP1_RANK0_CPU_RUN = LaunchEnv(**{**vars(FSDP1_RANK0), "use_cpu": True})


@pytest.mark.parametrize("launch,expected,threads,quantized_on_gpu", [
    (FSDP1_PER_RANK, {"": "cpu"}, None, True), (FSDP1_RANK0, {"": "cpu"}, None, True), (FSDP2, {"": "cpu"}, None, True),
    (DDP, None, None, False), (FSDP2_CPU_RUN, {"": "cpu"}, 8, False), (FSDP1_RANK0_CPU_RUN, {"": "cpu"}, 16, False)],
    ids=["fsdp1-every-rank-loads", "fsdp1-rank0-loads-once", "fsdp2", "ddp", "fsdp2-cpu-run", "fsdp1-once-cpu-run"])
def test_load_model_asks_from_pretrained_for_the_decided_placement(monkeypatch, tiny, launch, expected, threads,
                                                                   quantized_on_gpu):
    """What `from_pretrained` is asked to do for a CUDA launch (simulated): the CPU under FSDP, each weight quantized
    on this rank's GPU (transformers' Bnb4bitQuantize.convert wrapped while it loads, torch's threads untouched); a
    CPU run (ACCELERATE_USE_CPU) quantizes on the CPU with this rank's share of the machine's CPUs (all of them for
    the only rank that loads: FSDP1 with cpu_ram_efficient_loading); the quantizer's default (no device_map) under
    DDP."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize

    _simulate_cuda(monkeypatch)
    seen = {}
    convert = Bnb4bitQuantize.convert

    def from_pretrained(*args, **kwargs):
        seen.update(kwargs, threads=torch.get_num_threads(), wrapped=Bnb4bitQuantize.convert is not convert)
        raise _Stop

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(model_module.os, "sched_getaffinity", lambda pid: set(range(16)))
    training_args = type("T", (), {"trust_remote_code": False})()
    before = torch.get_num_threads()
    with pytest.raises(_Stop):
        model_module.load_model(qlora_args(str(tiny.model_dir)), training_args, None, launch)
    assert seen.get("device_map") == expected
    assert seen["quantization_config"].load_in_4bit
    assert seen["threads"] == (max(before, threads) if threads else before)  # of 16 CPUs, 2 ranks on the machine
    assert seen["wrapped"] is quantized_on_gpu
    assert torch.get_num_threads() == before and Bnb4bitQuantize.convert is convert  # put back, even when it fails
    plan = decide_load(qlora_args(str(tiny.model_dir)), launch)  # what load_model followed
    assert plan.device_map == expected and plan.reads_weights
    assert plan.quantize_on == (torch.device("cuda", 3) if quantized_on_gpu else None)
    assert plan.quantizes_on_cpu is bool(threads) and plan.sole_loader is (launch.fsdp_version == 1 and
                                                                           launch.cpu_ram_efficient_loading)


@pytest.fixture(scope="module")
def quantizable_model(tiny, tmp_path_factory):
    """name -> a tiny checkpoint: the Llama demo, the families a load must handle (tied, two MoE styles, Gemma, a
    non-Llama layout) and GPT-2, whose Conv1D weights transformers transposes before it quantizes them."""
    from sft_recipe.tiny.families import build_family_model

    root = tmp_path_factory.mktemp("quantizable")

    def build(name: str):
        if name == "llama-demo":
            return tiny.model_dir
        if name == "gpt2-conv1d":
            from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

            out = root / name
            if not out.is_dir():
                torch.manual_seed(0)
                GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=512)).save_pretrained(out)
                AutoTokenizer.from_pretrained(str(tiny.model_dir)).save_pretrained(out)
            return out
        return build_family_model(root, tiny.root, name)

    return build


def test_the_recording_device_copies_each_move_and_refuses_a_mixed_call():
    """The device the next test runs on: a move is a copy, marked until it comes back, and a call mixing the device
    with the CPU fails as on CUDA (what a move the wrapper forgot would do)."""
    device = RecordingDevice()
    x = torch.ones(4, 4)
    with device:
        there = x.to(device.device)
        assert there.device == device.device and there is not x and device.marked(there) and not device.marked(x)
        doubled = there * 2
        assert device.marked(doubled) and doubled.device == device.device
        with pytest.raises(RuntimeError, match="tensors on privateuseone:0 and on the CPU in one call"):
            doubled + x
        back = doubled.to("cpu")
        assert not device.marked(back) and back.device.type == "cpu" and torch.equal(back, x * 2)
    assert (device.to_device, device.to_cpu) == ([(4, 4)], [(4, 4)])


@pytest.mark.parametrize("name", ["llama-demo", "qwen2", "mixtral", "deepseek-v3", "gemma3", "gpt-neox",
                                  "gpt2-conv1d"])
def test_each_weight_quantized_on_a_device_comes_back_as_the_cpu_load(quantizable_model, name):
    """compat.quantize_each_weight_on, on a device whose moves are real copies (tests/recording_device.py; the GPU
    check's qlora vs qlora-cpuquant rows run it on CUDA): transformers' convert is handed each weight on the device,
    one at a time, bitsandbytes quantizes it there, and what comes back is on the CPU -- packed weight and every
    quantization-state tensor copied back, none left on the device, the layer's own state the weight's -- and byte
    for byte the plain CPU load, computing the same logits."""
    from bitsandbytes.nn import Params4bit
    from transformers import AutoModelForCausalLM
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize

    from sft_recipe.compat import quantize_each_weight_on
    from sft_recipe.measure import quant_state_tensors

    path = str(quantizable_model(name))

    def load():
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config(qlora_args()),
                                                    dtype=torch.bfloat16, device_map=dict(CPU_DEVICE_MAP))

    reference = load()
    original = Bnb4bitQuantize.convert
    calls = []
    device = RecordingDevice()

    def counting(self, input_dict, *args, **kwargs):
        calls.append({key: (v[0] if isinstance(v, list) else v).device for key, v in input_dict.items()})
        out = original(self, input_dict, *args, **kwargs)
        calls[-1]["quantized there"] = all(device.marked(p) and device.marked(p.quant_state.absmax)
                                           for p in out.values())
        return out

    Bnb4bitQuantize.convert = counting
    try:
        with device, quantize_each_weight_on(device.device):
            assert Bnb4bitQuantize.convert is not counting  # wrapped while loading
            model = load()
        assert Bnb4bitQuantize.convert is counting  # put back
    finally:
        Bnb4bitQuantize.convert = original
    linear4bit = [m for m in model.modules() if isinstance(getattr(m, "weight", None), Params4bit)]
    assert len(calls) == len(linear4bit) > 0 and all(len(c) == 2 for c in calls)  # one weight per call
    assert all(c["quantized there"] and {v for k, v in c.items() if k != "quantized there"} == {device.device}
               for c in calls)
    # each weight went to the device once, as the checkpoint holds it (GPT-2's Conv1D: transposed after)
    weights_moved = [shape for shape in device.to_device if len(shape) == 2]
    assert sorted(torch.Size(s).numel() for s in weights_moved) == sorted(
        p.quant_state.shape.numel() for p in reference.parameters() if isinstance(p, Params4bit))
    for layer in linear4bit:
        assert layer.weight.bnb_quantized and layer.weight.device.type == "cpu" and not device.marked(layer.weight)
        assert layer.weight.module is layer and layer.quant_state is layer.weight.quant_state
    ours = dict(model.named_parameters())
    for key, expected in reference.named_parameters():
        assert ours[key].dtype == expected.dtype and ours[key].shape == expected.shape, key
        assert torch.equal(ours[key].data.view(torch.uint8), expected.data.view(torch.uint8)), key
    ours_state, reference_state = quant_state_tensors(model), quant_state_tensors(reference)
    assert len(ours_state) == len(reference_state) > len(linear4bit)
    for a, b in zip(ours_state, reference_state):
        assert a.device.type == "cpu" and not device.marked(a) and a.dtype == b.dtype and torch.equal(a, b)
    assert len(device.to_cpu) >= len(ours_state)  # each of them came back by a copy
    # With grad (as training runs): under no_grad bitsandbytes re-lays out the packed bytes for its CPU kernel,
    # which refuses some of these tiny shapes.
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_the_ranks_that_receive_the_base_never_read_it(monkeypatch, tiny):
    """FSDP1 with cpu_ram_efficient_loading, rank 1: no from_pretrained; the 4-bit layers built on meta and handed
    to share_quantization_state to receive rank 0's state on this rank's GPU (CUDA simulated: cuda:3)."""
    from transformers import AutoModelForCausalLM

    _simulate_cuda(monkeypatch)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("read the weights"))
    received = []
    monkeypatch.setattr(model_module, "share_quantization_state",
                        lambda model, launch, device: received.append((model, device)))
    training_args = type("T", (), {"trust_remote_code": False})()
    tokenizer = type("Tok", (), {"__len__": lambda self: 0})()
    model = model_module.load_model(qlora_args(str(tiny.model_dir)), training_args, tokenizer, FSDP1)
    ((shared, device),) = received
    assert shared is model and device == torch.device("cuda", 3)
    linear4bit = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert len(linear4bit) == 14 and all(m.weight.device.type == "meta" for m in linear4bit)
    assert model.is_loaded_in_4bit and model.hf_quantizer is not None  # what PEFT and TRL look for


def test_quantization_threads_share_the_machine_between_its_ranks():
    assert quantization_threads(LaunchEnv(world_size=8, local_world_size=8), 64, 1) == 8
    assert quantization_threads(LaunchEnv(world_size=16, local_world_size=8), 64, 1) == 8  # per machine
    assert quantization_threads(LaunchEnv(world_size=2), 2, 1) == 1  # CI: 2 CPUs, 2 ranks
    assert quantization_threads(LaunchEnv(), 16, 24) == 24  # never fewer than torch already uses
    assert quantization_threads(LaunchEnv(world_size=8, local_world_size=8), 64, 1, sole_loader=True) == 64


@pytest.fixture(scope="module")
def quantized_tiny(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny.model_dir), quantization_config=bnb_config(qlora_args()),
                                                dtype=torch.bfloat16, device_map=dict(CPU_DEVICE_MAP))


def _weight(model):
    return model.model.layers[0].self_attn.q_proj.weight


def test_moving_a_quantized_weight_keeps_its_state_and_never_quantizes_again(monkeypatch, quantized_tiny):
    """FSDP moves each unit's parameters with `p.to(device)` (FSDP1 `_move_states_to_device`, FSDP2 `fully_shard`);
    for a loaded Params4bit that must carry the quantization state along (bitsandbytes moves it in place) and leave
    the packed bytes as they are."""
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn import Params4bit

    weight = copy.deepcopy(_weight(quantized_tiny))
    packed, absmax = weight.data.clone(), weight.quant_state.absmax.clone()
    calls = []
    monkeypatch.setattr(bnb_functional, "quantize_4bit", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(
        AssertionError("quantized again")))

    same_device = weight.to("cpu")
    assert isinstance(same_device, Params4bit) and same_device.quant_state is weight.quant_state
    assert torch.equal(same_device.data.view(torch.uint8), packed.view(torch.uint8))
    state = weight.quant_state
    moved = weight.to("meta")  # another device (the only other one a CPU has): FSDP keeps what `.to` returns
    assert isinstance(moved, Params4bit) and moved.bnb_quantized
    assert moved.quant_state is state and state.absmax.device.type == "meta"
    assert state.state2.absmax.device.type == "meta"  # double quantization: the nested state moves too
    assert moved.shape == packed.shape and not calls
    assert torch.equal(_weight(quantized_tiny).quant_state.absmax, absmax)  # the model's own copy untouched

    # Negative control: an unquantized Params4bit does quantize when moved, so the patch above would have seen it.
    raw = Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4",
                     quant_storage=torch.bfloat16)
    with pytest.raises(AssertionError, match="quantized again"):
        raw.to("cpu")


# ---- DeepSpeed ZeRO-3: the whole quantized base on every GPU, refused where it cannot fit ------------------------

ZERO3 = LaunchEnv(rank=0, world_size=2, use_deepspeed=True, deepspeed_zero_stage="3", deepspeed_zero3_init=True,
                  deepspeed_zero3_save_16bit_model=True)


@pytest.fixture(scope="module")
def guide_qlora():
    """The guide's QLoRA run (Llama-2-70B architecture, shipped offline), parsed as for a GPU machine."""
    from sft_recipe.plan import parse_train_flags
    from tests.helpers import REPO

    return parse_train_flags(["--config", str(REPO / "recipes" / "llama2_70b_qlora.yaml"), "--model_name_or_path",
                              str(REPO / "sft_recipe" / "plan" / "models" / "llama-2-70b")], "cuda")


def test_zero3_qlora_is_refused_where_the_whole_quantized_base_does_not_fit_a_gpu(guide_qlora, caplog):
    from sft_recipe.preflight.load_checks import quantized_base_bytes, zero3_quantized_load_problems

    m, d, _, t = guide_qlora
    whole = quantized_base_bytes(m, d, t)
    assert 32 * 2**30 < whole < 38 * 2**30  # Llama-2-70B in NF4 + double quant, bf16 embeddings and head
    problems = zero3_quantized_load_problems(m, d, t, ZERO3, gpu_bytes=24 * 2**30)
    assert len(problems) == 1
    assert "whole quantized base (" in problems[0] and "this GPU has 24.0 GiB" in problems[0]
    # The number is the memory plan's load phase for this launch: the whole base and the framework overhead.
    from sft_recipe.plan.planner import plan_memory

    plan = plan_memory(m, d, t, ZERO3.accelerate_config(), None, 24.0, "cuda", ladder=False)
    assert plan.phases["load"] > whole and f"({plan.phases['load'] / 2**30:.1f} GiB" in problems[0]
    assert plan.fails_at == "load" and plan.verdict == "does not fit"
    assert "configs/fsdp_config_qlora.yaml" in problems[0]  # the command that works
    # Where it fits (an 80 GB GPU) it runs, and says once what loading costs there.
    with caplog.at_level("WARNING"):
        assert zero3_quantized_load_problems(m, d, t, ZERO3, gpu_bytes=80 * 2**30) == []
    assert "every GPU holds the whole quantized base" in caplog.text


def test_the_zero3_check_leaves_other_launches_alone(guide_qlora, monkeypatch):
    from sft_recipe.preflight import load_checks

    m, d, _, t = guide_qlora
    assert load_checks.zero3_quantized_load_problems(m, d, t, FSDP2, gpu_bytes=1) == []  # FSDP: loaded on the CPU
    zero2 = LaunchEnv(**{**vars(ZERO3), "deepspeed_zero_stage": "2"})
    assert load_checks.zero3_quantized_load_problems(m, d, t, zero2, gpu_bytes=1) == []  # ZeRO-2: DDP-like
    lora = ModelArguments(**{**vars(m), "use_4bit_quantization": False})
    assert load_checks.zero3_quantized_load_problems(lora, d, t, ZERO3, gpu_bytes=1) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU dry run: no GPU memory to exceed
    assert load_checks.zero3_quantized_load_problems(m, d, t, ZERO3) == []


def test_validate_refuses_zero3_qlora_on_a_small_gpu_before_loading(guide_qlora, monkeypatch):
    """Through the whole-config check, which runs before any weight is read."""
    from sft_recipe.config.args import ConfigError
    from sft_recipe.preflight import load_checks
    from sft_recipe.preflight.validate import validate

    m, d, r, t = guide_qlora
    monkeypatch.setattr(load_checks, "gpu_memory_bytes", lambda launch: 24 * 2**30)
    with pytest.raises(ConfigError) as refused:
        validate(m, d, r, t, ZERO3)
    assert any("QLoRA under DeepSpeed ZeRO-3" in p and "fsdp_config_qlora.yaml" in p for p in refused.value.problems)
