"""LoRA on a GPTQ base (upstream's run_peft_fsdp_gptq.sh): checks before any weight loads, and the loading.

A GPTQ checkpoint says so in its config (`quantization_config.quant_method: gptq`); transformers then loads it
through optimum + GPT-QModel. Three things found on this stack (transformers 5.24, optimum 2.3, gptqmodel 7.7):
- an explicit `quantization_config=None` makes transformers load the checkpoint UNquantized: plain Linear layers
  with random weights, no error (model.load_model passes none then);
- GPT-QModel's default kernel choice ("auto") picks inference-only kernels (CPU: TorchCpuAvx512Linear; GPU: Marlin
  and the like), whose `.train()` raises; "auto_trainable" picks one that supports backward (CPU: TorchAtenLinear);
- PEFT cannot merge LoRA into packed int4 weights ("Cannot merge LORA layers when the model is gptq quantized").

    python -m sft_recipe.train.gptq --build_tiny DIR     quantize the tiny model with GPTQ into DIR (tests, dry runs)
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

GPTQ_PACKAGES = ("optimum", "gptqmodel")
TRAINABLE_BACKEND = "auto_trainable"


def checkpoint_quant_method(model_name_or_path: str, trust_remote_code: bool = False) -> str | None:
    """`quant_method` of a pre-quantized checkpoint ("gptq", "awq", ...), or None. Reads the config only."""
    from sft_recipe.model.shape import read_config

    try:
        config = read_config(model_name_or_path, trust_remote_code)
    except Exception:
        return None  # unreadable configs are reported by the LoRA-target check
    return config_quant_method(config)


def config_quant_method(config) -> str | None:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)).lower() if method else None


def gptq_merge_refusal(base: str, config) -> str | None:
    """merge_adapter.py on an adapter whose base is a GPTQ checkpoint: why not, and what to do instead."""
    if config_quant_method(config) != "gptq":
        return None
    return (f"base model {base!r} is a GPTQ int4 checkpoint: LoRA cannot be merged into its packed weights (PEFT: "
            "\"Cannot merge LORA layers when the model is gptq quantized\"), and de-quantizing them would bake the "
            "int4 rounding error into the merged model. Fix: --base_model_name_or_path with the model it was "
            "quantized from (e.g. meta-llama/Llama-3.1-8B-Instruct for ...-GPTQ-INT4), or serve base + adapter "
            "unmerged.")


def missing_gptq_packages() -> list[str]:
    return [name for name in GPTQ_PACKAGES if importlib.util.find_spec(name) is None]


def gptq_problems(m, t, launch) -> list[str]:
    """Why a run on a GPTQ base cannot start under this launch (a LaunchEnv), [] when it can (or the base is not
    GPTQ)."""
    if checkpoint_quant_method(m.model_name_or_path, t.trust_remote_code) != "gptq":
        return []
    base = f"--model_name_or_path {m.model_name_or_path} is a GPTQ checkpoint"
    problems = []
    missing = missing_gptq_packages()
    if missing:
        problems.append(f"{base}, and loading it needs {' and '.join(missing)} (not installed). Fix: "
                        "`pip install optimum gptqmodel` (GPU: see the GPT-QModel README for its CUDA kernels; this "
                        "recipe's CPU tests use `bash scripts/setup_gptq.sh`), or train on the unquantized model.")
    if m.use_4bit_quantization or m.use_8bit_quantization:
        flag = "--use_4bit_quantization" if m.use_4bit_quantization else "--use_8bit_quantization"
        problems.append(f"{base} (already int4), and {flag} True asks bitsandbytes to quantize it again. Fix: "
                        f"{flag} False (run_peft_fsdp_gptq.sh passes --use_4bit_quantization False).")
    if not m.use_peft_lora:
        problems.append(f"{base}: its packed int4 weights cannot be fine-tuned directly. Fix: --use_peft_lora True.")
    if m.use_peft_lora and m.lora_target_modules.strip() == "all-linear":
        problems.append(f"{base}: --lora_target_modules all-linear finds only torch.nn.Linear layers, and GPTQ's int4 "
                        "layers are not (PEFT would adapt nothing but fail with \"Target modules ... not found\"). "
                        "Fix: name them, e.g. --lora_target_modules q_proj,k_proj,v_proj,o_proj,up_proj,gate_proj "
                        "(as run_peft_fsdp_gptq.sh).")
    if m.use_dora:
        problems.append(f"{base}: PEFT has no DoRA for GPTQ layers. Fix: --use_dora False.")
    if m.gptq_backend == "auto":
        problems.append(f"{base}: --gptq_backend auto lets GPT-QModel pick an inference-only kernel, which refuses "
                        f"training (\"... is an inference-only ... kernel\"). Fix: --gptq_backend {TRAINABLE_BACKEND} "
                        "(the default).")
    if launch.requested_fsdp_version == 2 and launch.cpu_ram_efficient_loading:
        problems.append(f"{base}, and FSDP2 with fsdp_cpu_ram_efficient_loading: true broadcasts rank 0's state "
                        "dict into sharded parameters, but the GPTQ layers' packed int4 weights are plain buffers "
                        "(accelerate 1.15 fails: \"'Tensor' object has no attribute 'device_mesh'\"). Fix: "
                        "fsdp_cpu_ram_efficient_loading: false in the accelerate config, or FSDP1 "
                        "(configs/fsdp_config.yaml, as run_peft_fsdp_gptq.sh).")
    return problems


def loading_kwargs(m, trust_remote_code: bool = False) -> dict:
    """Extra from_pretrained arguments for a GPTQ base: a trainable kernel (the checkpoint's own config is kept)."""
    if checkpoint_quant_method(m.model_name_or_path, trust_remote_code) != "gptq":
        return {}
    from transformers import GPTQConfig

    from sft_recipe.model.shape import read_config

    if m.gptq_backend == TRAINABLE_BACKEND:  # no inference-only kernel built on the way (~75 CPU-s on a new CPU box)
        from sft_recipe.compat.gptq_kernels import check_trainability_before_building

        check_trainability_before_building()

    saved = read_config(m.model_name_or_path, trust_remote_code).quantization_config
    saved = saved if isinstance(saved, dict) else saved.to_dict()
    # Only loading attributes (backend) are taken from this object; the quantization itself comes from the checkpoint.
    return {"quantization_config": GPTQConfig(bits=saved.get("bits", 4), backend=m.gptq_backend)}


def build_tiny_gptq(source: str | Path, dest: str | Path, group_size: int = 32) -> Path:
    """Quantize a (tiny) model with real GPTQ on the CPU, calibrated on its own chat data, and save it to dest.
    group_size 32: the tiny model's layers are 64/128 wide, and GPTQ groups must divide the input width."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # On CPU, GPT-QModel 7.7's "auto" hands the quantized model back with its AVX512 inference kernel, which it
    # JIT-compiles the first time on a machine (~75 CPU-s); the plain torch kernel needs no compile, and the checkpoint
    # saved is byte-identical (cmp of both builds, 2026-12-07). Its block packer is compiled too (~20 CPU-s) unless
    # GPTQMODEL_DISABLE_PACK_EXT=1 (the Python packer, same bytes): tests/test_gptq.py sets it for its build.
    tokenizer = AutoTokenizer.from_pretrained(source)
    calibration = [f"calibration sample {i}: the quick brown fox answers question {i}" for i in range(16)]
    config = GPTQConfig(bits=4, group_size=group_size, dataset=calibration, tokenizer=tokenizer, desc_act=False,
                        backend="gptq_torch" if device == "cpu" else "auto")
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, device_map=device,
                                                 dtype=torch.float32)
    dest = Path(dest)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build_tiny", metavar="DIR", required=True, help="where to write the tiny GPTQ model")
    parser.add_argument("--source", default=".tiny/model", help="unquantized model to quantize")
    args = parser.parse_args(argv)
    missing = missing_gptq_packages()
    if missing:
        print(f"error: {' and '.join(missing)} not installed; run `bash scripts/setup_gptq.sh`.")
        return 2
    print(f"GPTQ model written to {build_tiny_gptq(args.source, args.build_tiny)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
