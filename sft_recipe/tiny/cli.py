"""Embedded, offline default for the SFT recipe: a tiny random Llama, a tokenizer and a learnable chat dataset.

Usage::

    python -m sft_recipe.tiny --output_dir .tiny            # build once; later calls are no-ops
    python -m sft_recipe.tiny --output_dir .tiny --force    # rebuild
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sft_recipe.tiny.store import TinyPaths, build_tiny, is_ready


def main(argv: Sequence[str] | None = None) -> int:
    # prog: argparse would name the file it was started from, which under `python -m` is __main__.py.
    parser = argparse.ArgumentParser(prog="python -m sft_recipe.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=".tiny", help="where to build the bundle (default: .tiny)")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    args = parser.parse_args(argv)

    if not args.force and is_ready(
        args.output_dir, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, seed=args.seed
    ):
        print(f"{TinyPaths.under(args.output_dir).root} is up to date")
        return 0
    paths = build_tiny(
        args.output_dir,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        seed=args.seed,
        force=args.force,
    )
    print(f"built {paths.root}")
    print(f"  model + tokenizer: {paths.model_dir}")
    print(f"  datasets:          {paths.disk_dir} (save_to_disk), {paths.jsonl_dir}, {paths.parquet_dir}")
    print(f"  rendered text:     {paths.text_dir}")
    return 0
