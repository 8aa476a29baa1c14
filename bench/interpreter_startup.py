"""CPU-seconds of one launched process under two interpreters, side by side: the tiny one-process train.py run
(8 steps; most of it start-up: imports), A B A B ..., the median of each and the ratio pair by pair.

    .venv/bin/python bench/interpreter_startup.py --python /other/venv/bin/python [--python .venv/bin/python]
        [--pairs 8]

Each --python is a venv's interpreter with requirements.txt installed (scripts/setup.sh with PYTHON= and VENV=).
Why it matters: a suite launches ~700 such processes (docs/testing.md), and scripts/pick_python.py chooses the
interpreter .venv is built from by what this prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run_cpu_seconds(python: str, model_dir: Path, data_dir: Path) -> float:
    """user + sys CPU-seconds of one train.py process (and anything it started), from the kernel's accounting."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": f"{out}/cache"}
        proc = subprocess.Popen([python, "train.py", "--model_name_or_path", str(model_dir), "--dataset_name",
                                 str(data_dir), "--chat_template_format", "chatml", "--max_steps", "8", "--bf16",
                                 "False", "--per_device_train_batch_size", "2", "--plot_loss_curve", "False",
                                 "--output_dir", f"{out}/run"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stderr = proc.stderr.read()
        proc.stderr.close()
        if proc.returncode != 0:
            sys.exit(f"{python} train.py exited {proc.returncode}:\n{stderr[-2000:]}")
        return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True,
                        help="an interpreter (twice: A and B; once: A against .venv/bin/python)")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tiny", type=Path, default=REPO / ".tiny", help="sft_recipe.tiny's output (make tiny)")
    args = parser.parse_args()
    pythons = args.python if len(args.python) == 2 else [*args.python, str(REPO / ".venv/bin/python")]
    model_dir, data_dir = args.tiny / "model", args.tiny / "data/jsonl"
    for python in pythons:  # warm-up: page cache, bytecode
        one_run_cpu_seconds(python, model_dir, data_dir)
    seconds: dict[str, list[float]] = {p: [] for p in pythons}
    for _ in range(args.pairs):
        for python in pythons:
            seconds[python].append(one_run_cpu_seconds(python, model_dir, data_dir))
    a, b = pythons
    ratios = [x / y for x, y in zip(seconds[a], seconds[b])]
    print("| interpreter | Python | CPU-s median (min-max) |")
    print("|---|---|---|")
    for python in pythons:
        version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        runs = seconds[python]
        print(f"| {python} | {version} | {statistics.median(runs):.2f} ({min(runs):.2f}-{max(runs):.2f}) |")
    print(f"\nA/B pair by pair ({args.pairs} pairs): median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); A = {a}, B = {b}")


if __name__ == "__main__":
    main()
