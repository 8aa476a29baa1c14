"""One rank of tests/e2e/test_quantized_load.py: load a 4-bit base as train.py does, and fingerprint it.

Launched by the test, never by hand in normal use:
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp2_config.yaml \
        tests/e2e/quantized_load_worker.py --out_dir /tmp/q --model_name_or_path .tiny/model [train.py flags]

Every rank parses train.py's flags for this launch, loads the model with `load_model` (the recipe's placement:
compat.quantized_base_device_map) and writes <out_dir>/rank<N>.json: the device map it decided and a sha256 of
every packed 4-bit weight and every tensor of its quantization state (absmax, code, nested state), then what the
run-time identity check (sft_recipe.train.quantized_identity) said, as train.py calls it. `--perturb_rank N`: rank N
changes one absmax value first, as a machine that quantizes differently would (the check must stop every rank).
Without a launcher (one process) it writes <out_dir>/one-process.json. It asserts nothing itself; it ends as train.py
does (compat.exit_skipping_teardown: gloo can abort a finished rank at interpreter teardown, about once in 40).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def fingerprint(tensor) -> str:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def quantized_fingerprints(model) -> dict[str, str]:
    """sha256 of each 4-bit weight's packed bytes and of each tensor in its quantization state, by name."""
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is None:
            continue
        out[f"{name}.weight"] = fingerprint(weight.data)
        for field in ("absmax", "code", "offset"):
            value = getattr(state, field, None)
            if value is not None:
                out[f"{name}.{field}"] = fingerprint(value)
        nested = getattr(state, "state2", None)
        if nested is not None:
            out[f"{name}.state2.absmax"] = fingerprint(nested.absmax)
            out[f"{name}.state2.code"] = fingerprint(nested.code)
    return out


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    if flag not in argv:
        return None, argv
    i = argv.index(flag)
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> None:
    out, argv = _take(argv, "--out_dir")
    out_dir = Path(out)
    perturb, argv = _take(argv, "--perturb_rank")
    from sft_recipe.startup import freeze_imports, prepare_imports

    prepare_imports(argv)  # as train.py decides for these flags: bitsandbytes imported with its compiles deferred
    from sft_recipe import compat
    from sft_recipe.config.args import parse_args
    from sft_recipe.config.launch_env import read_launch_env
    from sft_recipe.train.model import load_model, load_tokenizer

    freeze_imports()

    launch = read_launch_env()
    model_args, _, _, training_args = parse_args([*argv, "--output_dir", str(out_dir / "unused")], launch)
    compat.install(launch)
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, training_args, tokenizer, launch)
    if perturb is not None and launch.rank == int(perturb):
        import torch

        with torch.no_grad():
            state = next(m.weight.quant_state for m in model.modules()
                         if getattr(getattr(m, "weight", None), "quant_state", None) is not None)
            state.absmax.view(-1)[0] += 1
    from sft_recipe.errors import ConfigError
    from sft_recipe.train.quantized_identity import check_quantized_base_identical

    try:
        identity = {"note": check_quantized_base_identical(model, launch)}
    except ConfigError as e:
        identity = {"problems": e.problems}
    name = f"rank{launch.rank}" if launch.world_size > 1 else "one-process"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({
        "device_map": compat.quantized_base_device_map(model_args, launch),
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "fingerprints": quantized_fingerprints(model), "identity": identity}, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():  # as train.py: gloo's threads can abort a finished rank at interpreter teardown
        dist.barrier()  # every rank has written its file
        dist.destroy_process_group()
    compat.exit_skipping_teardown(2 if "problems" in identity else 0, launch.world_size)


if __name__ == "__main__":
    main(sys.argv[1:])
