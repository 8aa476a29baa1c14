"""A bigger seeded random Llama with the tiny tokenizer, for the benchmarks whose memory the weights must dominate."""

from __future__ import annotations

from pathlib import Path

from sft_recipe.tiny.build import build_model
from sft_recipe.tiny.store import build_tiny


def build_bench_model(root, tiny_dir, hidden_size: int = 1024, num_hidden_layers: int = 8):
    """A seeded random Llama (fp32) whose weights dominate memory, with the tiny tokenizer, saved under `root`
    (what bench/memory_plan.py and bench/throughput.py train). Builds the tiny default in `tiny_dir` if missing."""
    from transformers import AutoTokenizer

    build_tiny(Path(tiny_dir))  # no-op when already built
    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_dir) / "model"))
    model = build_model(tokenizer, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers)
    out = Path(root) / f"llama-{hidden_size}x{num_hidden_layers}"
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out
