"""GPU throughput for the lent H200 (one prepared call): an 8B-shaped random Llama, LoRA r=8 on all linear layers,
bf16, sequence 2048, gradient checkpointing; SDPA vs flash-attn (when installed), padding-free packing vs padded
batches. Prints tokens/s, MFU and peak memory per setup.

    python bench/gpu_throughput.py                     # on a GPU machine (about 6 minutes on one H200)
    python bench/gpu_throughput.py --cpu_smoke         # the same code path on a tiny config on CPU (used by tests)

Needs only torch, transformers and peft (what the GPU image has; no TRL, datasets or weights): the model is built
from a config with random weights, and batches are synthetic documents of random lengths (128..2048 tokens).
"Packed" lays documents end to end in one row of `seq_len` with position ids restarting per document (no attention
mask: transformers builds the per-document mask from them; flash-attn uses them as varlen boundaries); "padded" puts
one document per row, padded to the longest, with an attention mask. tokens/s counts real (non-padding) tokens, so the
two are comparable. MFU uses `sft_recipe.train.flops.FlopsModel` against `--peak_tflops` (H200/H100 dense bf16: 989).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512)


def build_model(shape: dict, attention: str, device: str, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, attn_implementation=attention, use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def document_lengths(generator: torch.Generator, total: int, low: int, high: int) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - total  # the last document fills the row exactly
    return [n for n in lengths if n > 1]


def packed_batch(generator, vocab: int, seq_len: int, rows: int, device: str) -> tuple[dict, int]:
    ids, positions = [], []
    for _ in range(rows):
        lengths = document_lengths(generator, seq_len, max(2, seq_len // 16), seq_len)
        ids.append(torch.randint(0, vocab, (sum(lengths),), generator=generator))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
    input_ids = torch.stack(ids).to(device)
    labels = input_ids.clone()
    position_ids = torch.stack(positions).to(device)
    labels[position_ids == 0] = -100  # a document's first token is not predicted from the previous document
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}, int(input_ids.numel())


def padded_batch(generator, vocab: int, seq_len: int, rows: int, device: str) -> tuple[dict, int]:
    lengths = [int(torch.randint(max(2, seq_len // 16), seq_len + 1, (1,), generator=generator)) for _ in range(rows)]
    longest = max(lengths)
    input_ids = torch.zeros(rows, longest, dtype=torch.long)
    attention_mask = torch.zeros(rows, longest, dtype=torch.long)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(0, vocab, (n,), generator=generator)
        attention_mask[row, :n] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}, sum(lengths)


def measure(shape: dict, attention: str, packing: bool, *, device: str, dtype, seq_len: int, rows: int,
            steps: int, warmup: int, peak_tflops: float | None) -> dict:
    from sft_recipe.train.flops import FlopsModel, count_params

    model = build_model(shape, attention, device, dtype)
    total, trainable = count_params(model)
    flops = FlopsModel(total, trainable, shape["num_hidden_layers"], shape["hidden_size"], seq_len, True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    make = packed_batch if packing else padded_batch
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, start = 0, None
    for step in range(warmup + steps):
        if step == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            tokens, start = 0, time.perf_counter()
        batch, real_tokens = make(generator, shape["vocab_size"], seq_len, rows, device)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += real_tokens
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_second = tokens / seconds
    result = {"attention": attention, "packing": "packed (padding-free)" if packing else "padded",
              "tokens_per_second": tokens_per_second, "loss": loss.detach().item(),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
              "mfu": tokens_per_second * flops.per_token() / (peak_tflops * 1e12) if peak_tflops else None}
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def print_table(results: list[dict], skipped: list[str]) -> None:
    print("| attention | batches | tokens/s | MFU | peak memory GiB | final loss |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"| {r['attention']} | {r['packing']} | {r['tokens_per_second']:.0f} | {mfu} | {memory} | "
              f"{r['loss']:.3f} |")
    for line in skipped:
        print(f"skipped: {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu_smoke", action="store_true", help="tiny config, fp32, on CPU: checks the code path")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4, help="sequences per step (micro-batch)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="dense bf16 peak of one device")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        shape, device, dtype = TINY, "cpu", torch.float32
        args.seq_len, args.rows, args.steps, args.warmup, args.peak_tflops = 128, 2, 2, 1, None
    elif not torch.cuda.is_available():
        print("error: no CUDA GPU is visible. This benchmark is for a GPU machine; on CPU run bench/throughput.py "
              "(or --cpu_smoke to check this script's code path).", file=sys.stderr)
        return 2
    else:
        shape, device, dtype = LLAMA_8B, "cuda", torch.bfloat16
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    attentions, skipped = ["sdpa"], []
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        attentions.append("flash_attention_2")
    else:
        skipped.append("flash_attention_2 (flash-attn is not installed" +
                       (", and needs CUDA)" if device == "cpu" else "; carry its wheel to compare)"))
    results = []
    for attention in attentions:
        for packing in (True, False):
            results.append(measure(shape, attention, packing, device=device, dtype=dtype, seq_len=args.seq_len,
                                   rows=args.rows, steps=args.steps, warmup=args.warmup,
                                   peak_tflops=args.peak_tflops))
    print_table(results, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
