"""Renting questions, answered from the model config alone: the fewest GPUs of a given memory that fit a run
(fewest_gpus), and the longest --max_seq_len that fits a setup (longest_seq_len).

    python -m sft_recipe.plan --fewest_gpus --gpu_memory_gib 80 --config recipes/llama2_70b_lora.yaml
    python -m sft_recipe.plan --longest_seq_len --gpu_memory_gib 24 --config_file configs/fsdp_config_qlora.yaml \
        --config recipes/llama2_70b_qlora.yaml

Both search over plan_memory (nothing here sizes memory itself): fewest_gpus plans each engine (FSDP1 and FSDP2
FULL_SHARD, with and without fsdp_offload_params; DeepSpeed ZeRO-3, with and without CPU offload; DDP, whose every
GPU holds the whole model) at 1..8 GPUs, then whole machines of 8, and keeps the first count whose every phase
fits; longest_seq_len binary-searches --max_seq_len on the plan's peak (it grows with the sequence in every
term), with gradient checkpointing on and off, and with TRL's --activation_offloading on and off where it applies
(CUDA). Each answer carries its plan (the rows are the breakdown)
and the command that launches it. The micro-batch stays as given: the global batch (GPUs x micro-batch x
accumulation) grows with the GPUs, and each fewest-GPUs answer says which --gradient_accumulation_steps keeps the
run's own global batch.
"""

from __future__ import annotations

import copy
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sft_recipe.errors import ConfigError
from sft_recipe.plan.inputs import parse_train_flags, read_accelerate_config, workload
from sft_recipe.plan.planner import plan_memory
from sft_recipe.plan.result import GIB, MemoryPlan
from sft_recipe.plan.shape import ModelShape, model_shape, resolve_model_config_dir

NO_ACT_OFFLOAD_FSDP1 = "train.py refuses --activation_offloading under FSDP1: see fsdp2"
GPUS_PER_MACHINE = 8
MAX_GPUS = 1024
MAX_SEQ_LEN = 1 << 20
ENGINES = ("fsdp1", "fsdp2", "zero3", "ddp")
REPO = Path(__file__).resolve().parents[2]  # a checkout's root: configs/ lives there (not in an installed package)
# engine -> (accelerate YAML for one machine, for several); the command names it and the plan reads it when present.
ENGINE_YAMLS = {"fsdp1": ("configs/fsdp_config.yaml", "configs/multi_node/fsdp_config.yaml"),
                "fsdp2": ("configs/fsdp2_config.yaml", "configs/multi_node/fsdp2_config.yaml"),
                "zero3": ("configs/deepspeed_config.yaml", "configs/deepspeed_config.yaml"),  # multinode: standard
                "ddp": ("configs/single.yaml", None)}
_FSDP = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_cpu_ram_efficient_loading": True,
         "fsdp_offload_params": False}
FALLBACK_CONFIGS = {  # what configs/*.yaml say, for an installed package without them
    "fsdp1": {"distributed_type": "FSDP", "mixed_precision": "bf16",
              "fsdp_config": {**_FSDP, "fsdp_sharding_strategy": "FULL_SHARD"}},
    "fsdp2": {"distributed_type": "FSDP", "mixed_precision": "bf16",
              "fsdp_config": {**_FSDP, "fsdp_version": 2, "fsdp_reshard_after_forward": True}},
    "zero3": {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
              "deepspeed_config": {"zero_stage": 3, "zero3_init_flag": True, "offload_optimizer_device": "none",
                                   "offload_param_device": "none", "zero3_save_16bit_model": True}},
    "ddp": {"distributed_type": "NO", "mixed_precision": "bf16"},
}
FSDP2_TWINS = {"configs/fsdp_config.yaml": "configs/fsdp2_config.yaml",
               "configs/fsdp_config_qlora.yaml": "configs/fsdp2_config_qlora.yaml",
               "configs/multi_node/fsdp_config.yaml": "configs/multi_node/fsdp2_config.yaml"}
_SEQ_FLAGS, _CKPT_FLAGS = ("--max_seq_len", "--max_length"), ("--gradient_checkpointing", "--activation_checkpointing")


@dataclass
class Run:
    """One run to rent for: train.py's flags (parsed, and as the command shows them), its accelerate YAML (the path
    as given, and the dict with any launcher override applied), and plan_memory's keywords (cuda_context_gib,
    load_path, dora, ...)."""

    model_args: Any
    data_args: Any
    training_args: Any
    train_argv: list[str]
    config_file: str | None
    accelerate_config: dict
    device: str = "cuda"
    knobs: dict = field(default_factory=dict)
    shape: ModelShape | None = None

    def __post_init__(self):
        self.workload = workload(self.model_args, self.data_args, self.training_args, self.device)
        if self.shape is None:
            self.shape = model_shape(self.model_args.model_name_or_path,
                                     bool(getattr(self.training_args, "trust_remote_code", False)),
                                     self.workload.extra_vocab)


def run_from_flags(train_argv: list[str], config_file: str | None = None, device: str = "cuda",
                   accelerate_config: dict | None = None, **knobs) -> Run:
    """A Run from train.py's flags as a user types them (the commands repeat them) and an accelerate YAML path."""
    model_args, data_args, _, training_args = parse_train_flags(train_argv, device)
    cfg = accelerate_config if accelerate_config is not None else read_accelerate_config(config_file)
    return Run(model_args, data_args, training_args, list(train_argv), config_file, cfg, device, knobs)


@dataclass
class Answer:
    """One answer: the setup it is for, whether anything fits, the plan there and the command that launches it."""

    question: str  # "fewest_gpus" | "longest_seq_len"
    engine: str
    offload: bool  # fsdp_offload_params
    checkpointing: bool
    activation_offloading: bool
    num_processes: int
    num_machines: int
    seq_len: int
    fits: bool
    plan: MemoryPlan | None  # at the answer; when nothing fits, at the last setup tried; None: not applicable
    command: str
    global_batch: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        keys = ("question", "engine", "offload", "checkpointing", "activation_offloading", "num_processes",
                "num_machines", "seq_len", "fits", "command", "global_batch", "note")
        plan = self.plan
        return {**{k: getattr(self, k) for k in keys}, "per_gpu_gib": round(plan.peak_gib, 3) if plan else None,
                "host_peak_gib": round(plan.host_peak_bytes / GIB, 3) if plan else None,
                "plan": plan.to_dict() if plan else None}


def engine_of(cfg: dict) -> str | None:
    kind = str(cfg.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        return "fsdp2" if int((cfg.get("fsdp_config") or {}).get("fsdp_version", 1)) == 2 else "fsdp1"
    if kind == "DEEPSPEED":
        return "zero3" if str((cfg.get("deepspeed_config") or {}).get("zero_stage", 2)) == "3" else "zero2"
    return "ddp" if kind in ("NO", "MULTI_GPU") else None


def engine_config(run: Run, engine: str, machines: int) -> tuple[str | None, dict]:
    """The accelerate YAML an engine launches with: the run's own when it is that engine (and spans as many
    machines), else the shipped one (configs/, or its packaged copy). Returns (path for the command, dict)."""
    if run.config_file and engine_of(run.accelerate_config) == engine and (machines > 1) == (
            int(run.accelerate_config.get("num_machines") or 1) > 1):
        return run.config_file, own_yaml(run)
    path = ENGINE_YAMLS[engine][machines > 1]
    if path and (REPO / path).is_file():
        return path, read_accelerate_config(REPO / path)
    return path, FALLBACK_CONFIGS[engine]


def own_yaml(run: Run) -> dict:
    """The run's accelerate YAML as its file says (the launch command adds what differs), without overrides."""
    return read_accelerate_config(run.config_file) if run.config_file else run.accelerate_config


def fsdp2_twin(run: Run) -> tuple[str, dict] | None:
    """The shipped FSDP2 YAML beside the run's shipped FSDP1 one (train.py refuses --activation_offloading under
    FSDP1), with the run's GPU count and offload; None for a YAML without a shipped twin."""
    twin = FSDP2_TWINS.get(Path(run.config_file or "").as_posix().removeprefix("./"))
    if twin is None or not (REPO / twin).is_file():
        return None
    fc = run.accelerate_config.get("fsdp_config") or {}
    cfg = read_accelerate_config(REPO / twin)
    return twin, {**cfg, "num_processes": run.accelerate_config.get("num_processes", cfg.get("num_processes")),
                  "fsdp_config": {**cfg["fsdp_config"], "fsdp_offload_params": bool(fc.get("fsdp_offload_params"))}}


def with_flags(argv: list[str], flags: dict[tuple[str, ...], str | None]) -> list[str]:
    """argv with each flag (any of its names, as `--f v` or `--f=v`) removed, then `--<first name> value` appended
    (value None: removed only)."""
    out, names, i = [], {n for k in flags for n in k}, 0
    while i < len(argv):
        token = argv[i]
        if token.split("=", 1)[0] in names:
            i += 1 if "=" in token or i + 1 >= len(argv) or argv[i + 1].startswith("--") else 2
            continue
        out.append(token)
        i += 1
    for keys, value in flags.items():
        if value is not None:
            out += [keys[0], value]
    return out


def launch_command(config_file: str | None, num_processes: int, machines: int, offload: bool | None,
                   train_argv: list[str], cfg: dict) -> str:
    """`accelerate launch ... train.py ...`: offload given only where it differs from the YAML."""
    cmd = ["accelerate", "launch"]
    if engine_of(cfg) == "ddp" and num_processes > 1:
        cmd += ["--multi_gpu"] + (["--mixed_precision", str(cfg["mixed_precision"])] if "mixed_precision" in cfg
                                  else [])
    elif config_file:
        cmd += ["--config_file", str(config_file)]
    if machines > 1:
        cmd += ["--num_machines", str(machines), "--machine_rank", f"<0..{machines - 1}>",
                "--main_process_ip", "<host of machine 0>"]
    cmd += ["--num_processes", str(num_processes)]
    if engine_of(cfg) in ("zero2", "zero3"):
        if offload is not None and offload != (_ds_offloads(cfg)):
            device = "cpu" if offload else "none"
            cmd += ["--offload_optimizer_device", device] + (["--offload_param_device", device]
                                                             if engine_of(cfg) == "zero3" else [])
    elif offload is not None and offload != bool((cfg.get("fsdp_config") or {}).get("fsdp_offload_params", False)):
        cmd += ["--fsdp_offload_params", "true" if offload else "false"]
    return " ".join([*cmd, "train.py", *(shlex.quote(t) for t in train_argv)])


def _ds_offloads(cfg: dict) -> bool:
    dc = cfg.get("deepspeed_config") or {}
    return str(dc.get("offload_optimizer_device", "none")).lower() == "cpu"


def _plan(run: Run, cfg: dict, n: int, machines: int, offload: bool, budget: float, training_args=None):
    cfg = {**cfg, "num_processes": n, "num_machines": machines}
    if engine_of(cfg) in ("zero2", "zero3"):  # offload: the optimizer, and with ZeRO-3 the parameters
        device = "cpu" if offload else "none"
        cfg["deepspeed_config"] = {**(cfg.get("deepspeed_config") or {}), "offload_optimizer_device": device,
                                   "offload_param_device": device}
    elif engine_of(cfg) != "ddp":
        cfg["fsdp_config"] = {**(cfg.get("fsdp_config") or {}), "fsdp_offload_params": offload}
    elif n > 1:
        cfg["distributed_type"] = "MULTI_GPU"
    return plan_memory(run.model_args, run.data_args, training_args or run.training_args, cfg, None, budget,
                       run.device, ladder=False, shape=run.shape, **run.knobs), cfg


def _at(run: Run, engine: str, n: int, offload: bool, budget: float, gpus_per_machine: int):
    """(plan, accelerate dict planned, YAML path, YAML dict, machines) of an engine on n GPUs."""
    machines = max(1, math.ceil(n / gpus_per_machine))
    path, base = engine_config(run, engine, machines)
    plan, cfg = _plan(run, base, n, machines, offload, budget)
    return plan, cfg, path, base, machines


def _fits(plan: MemoryPlan, host_memory_gib: float | None) -> bool:
    return plan.fits and (host_memory_gib is None or plan.host_peak_bytes <= host_memory_gib * GIB)


def gpu_counts(gpus_per_machine: int = GPUS_PER_MACHINE, max_gpus: int = MAX_GPUS) -> list[int]:
    """1..gpus_per_machine on one machine, then whole machines (accelerate launches as many ranks on each)."""
    small = list(range(1, min(gpus_per_machine, max_gpus) + 1))
    return small + list(range(2 * gpus_per_machine, max_gpus + 1, gpus_per_machine))


def fewest_gpus(run: Run, gpu_memory_gib: float, engines: tuple[str, ...] = ENGINES,
                offload: tuple[bool, ...] = (False, True), gpus_per_machine: int = GPUS_PER_MACHINE,
                max_gpus: int = MAX_GPUS, host_memory_gib: float | None = None) -> list[Answer]:
    """Per engine and offload setting, the fewest GPUs of `gpu_memory_gib` on which every phase of the run fits
    (and host RAM per machine, when `host_memory_gib` is given). DDP replicates the model: one GPU fits or none does
    (more GPUs add speed, not memory); offload is FSDP's (fsdp_offload_params) or DeepSpeed's (the optimizer, and
    under ZeRO-3 the parameters). The micro-batch and accumulation stay as given."""
    if run.device != "cuda":
        raise ConfigError(["--fewest_gpus plans GPUs: use --device cuda (a CPU run's RAM per rank: --longest_seq_len "
                           "--device cpu)."])
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise ConfigError([f"--engines {','.join(unknown)}: unknown. Fix: any of {','.join(ENGINES)}."])
    ta = run.training_args
    per_step = ta.per_device_train_batch_size * ta.gradient_accumulation_steps
    reference = int(run.accelerate_config.get("num_processes") or 1) * per_step
    answers = []
    for engine in engines:
        for off in (o for o in offload if not (engine == "ddp" and o)):
            if engine in ("fsdp1", "zero3") and run.workload.activation_offloading:
                answers.append(Answer("fewest_gpus", engine, off, run.workload.gradient_checkpointing, True, 0, 0,
                                      run.workload.seq_len, False, None, "", 0,
                                      NO_ACT_OFFLOAD_FSDP1.replace("FSDP1", "FSDP1 or DeepSpeed")))
                continue
            counts = [1] if engine == "ddp" else gpu_counts(gpus_per_machine, max_gpus)
            most = _at(run, engine, counts[-1], off, gpu_memory_gib, gpus_per_machine)[0]
            if host_memory_gib is None and not most.fits:
                counts = counts[-1:]  # the most GPUs do not fit: no count does
            for n in counts:
                plan, cfg, path, base, machines = _at(run, engine, n, off, gpu_memory_gib, gpus_per_machine)
                if _fits(plan, host_memory_gib):
                    break
            fits = _fits(plan, host_memory_gib)
            note = ""
            if engine == "ddp":
                note = "DDP keeps the whole model on every GPU: more GPUs add speed, not memory"
            elif fits and reference % (n * ta.per_device_train_batch_size) == 0:
                accum = reference // (n * ta.per_device_train_batch_size)
                if accum != ta.gradient_accumulation_steps:
                    note = f"--gradient_accumulation_steps {accum} keeps the global batch of {reference}"
            if not fits and engine == "ddp":
                note = f"does not fit: every GPU holds the whole model ({plan.peak_gib:.1f} GiB)"
            elif not fits:
                note = (f"does not fit on {gpus(n)} either ({plan.peak_gib:.1f} GiB per GPU, host "
                        f"{plan.host_peak_bytes / GIB:.0f} GiB per machine): activations and buffers do not shrink "
                        "with more GPUs (a smaller micro-batch or --max_seq_len, checkpointing, activation offloading)")
            cmd = launch_command(path, n, machines, off if engine != "ddp" else None, run.train_argv, base)
            w = run.workload
            answers.append(Answer("fewest_gpus", engine, off, w.gradient_checkpointing, w.activation_offloading, n,
                                  machines, w.seq_len, fits, plan, cmd if fits else "", n * per_step, note))
    return answers


def _with_workload(training_args, seq_len: int, checkpointing: bool, activation_offloading: bool):
    ta = copy.copy(training_args)
    ta.max_length = seq_len
    ta.gradient_checkpointing = checkpointing
    if getattr(ta, "activation_checkpointing", None) is not None:
        ta.activation_checkpointing = checkpointing
    ta.activation_offloading = activation_offloading
    return ta


def longest_seq_len(run: Run, gpu_memory_gib: float, checkpointing: tuple[bool, ...] = (True, False),
                    activation_offloading: tuple[bool, ...] | None = None, max_seq_len: int = MAX_SEQ_LEN,
                    host_memory_gib: float | None = None) -> list[Answer]:
    """The longest --max_seq_len (packed row length; T = micro-batch x S tokens) whose every phase fits, for the
    run's own engine, GPU count and offload, with checkpointing on/off x activation offloading off/on (CUDA only:
    TRL offloads from an accelerator). Binary search: the peak grows with S in every term."""
    if activation_offloading is None:
        activation_offloading = (False, True) if run.device == "cuda" else (False,)
    if run.device != "cuda" and any(activation_offloading):
        raise ConfigError(["--activation_offloading on a CPU run: TRL 1.16 offloads from an accelerator and fails "
                           "without one. Fix: plan it with --device cuda."])
    cfg = run.accelerate_config
    n, machines = int(cfg.get("num_processes") or 1), int(cfg.get("num_machines") or 1)
    offload = bool((cfg.get("fsdp_config") or {}).get("fsdp_offload_params", False))
    context = model_context_length(run)
    ta0 = run.training_args
    global_batch = n * ta0.per_device_train_batch_size * ta0.gradient_accumulation_steps
    answers = []
    for ckpt in checkpointing:
        for act in activation_offloading:
            path, yaml_cfg, plan_cfg, note = run.config_file, own_yaml(run), cfg, ""
            if act and engine_of(cfg) == "fsdp1":  # train.py refuses it there: its shipped FSDP2 twin, if any
                twin = fsdp2_twin(run)
                if twin is None:
                    answers.append(Answer("longest_seq_len", "fsdp1", offload, ckpt, act, n, machines, 0, False,
                                          None, "", 0, "train.py refuses --activation_offloading under FSDP1: "
                                          "plan it with an FSDP2 YAML"))
                    continue
                path, plan_cfg = twin
                yaml_cfg, note = read_accelerate_config(REPO / path), f"FSDP2 ({path}): FSDP1 refuses it"
            lo, plan = _longest(run, plan_cfg, _with_workload(ta0, 1, ckpt, act), gpu_memory_gib, max_seq_len,
                                host_memory_gib)
            fits = lo > 0
            argv = with_flags(run.train_argv, {_SEQ_FLAGS: str(lo), _CKPT_FLAGS: str(ckpt),
                                               ("--activation_offloading",): "True" if act else None})
            if lo == max_seq_len:
                note = "; ".join(x for x in (note, f"fits at the search's cap of {max_seq_len}") if x)
            elif fits and context and lo > context:
                note = "; ".join(x for x in (note, f"beyond the model's context ({context} positions)") if x)
            elif not fits:
                note = f"does not fit even at --max_seq_len 1 ({plan.peak_gib:.1f} GiB)"
            cmd = launch_command(path, n, machines, offload, argv, yaml_cfg) if fits else ""
            answers.append(Answer("longest_seq_len", engine_of(plan_cfg) or "", offload, ckpt, act, n, machines, lo,
                                  fits, plan, cmd, global_batch, note))
    return answers


def _longest(run: Run, cfg: dict, training_args, budget: float, cap: int,
             host_memory_gib: float | None) -> tuple[int, MemoryPlan]:
    """(longest S in 1..cap that fits, or 0; the plan at max(S, 1)) by bisection on the plan's peak."""
    def plan_at(s: int) -> MemoryPlan:
        training_args.max_length = s
        return plan_memory(run.model_args, run.data_args, training_args, cfg, None, budget, run.device, ladder=False,
                           shape=run.shape, **run.knobs)

    lo, hi = 0, cap
    if _fits(plan_at(hi), host_memory_gib):
        lo = hi
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(plan_at(mid), host_memory_gib) else (lo, mid)
    return lo, plan_at(max(lo, 1))


def model_context_length(run: Run) -> int | None:
    """max_position_embeddings as the model's config declares it (None when it says none or cannot be read)."""
    try:
        from sft_recipe.model.shape import read_config

        where, _ = resolve_model_config_dir(run.model_args.model_name_or_path)
        config = read_config(where, bool(getattr(run.training_args, "trust_remote_code", False)))
        return getattr(config.get_text_config(), "max_position_embeddings", None)
    except Exception:  # noqa: BLE001 -- a note only
        return None


def gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"
