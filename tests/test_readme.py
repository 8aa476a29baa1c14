"""The README is a path the tests run: its commands run (here or in .ci/run), its file list is the repo's."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, launch_env, run_command

README = (REPO / "README.md").read_text()


def _code_lines() -> list[str]:
    lines, inside = [], False
    for line in README.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            lines.append(line)
    return lines


def test_the_two_fresh_machine_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("make demo", "make test"):
        assert any(line.startswith(command) for line in _code_lines())
        assert command in ci


def test_demo_script_runs_the_readme_evaluate_command():
    """The README's evaluate command is the one the demo runs (same flags and values, the adapter folder aside)."""
    readme = shlex.split(re.search(r"`(python -m sft_recipe\.evaluate [^`]+)`", README).group(1))
    demo_text = (REPO / "scripts" / "demo.sh").read_text().replace("\\\n", " ")
    line = next(line for line in demo_text.splitlines() if "python -m sft_recipe.evaluate" in line)
    demo = shlex.split(line[line.index("python -m sft_recipe.evaluate"):])

    def flags(words):
        return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}

    readme_flags, demo_flags = flags(readme), flags(demo)
    readme_flags.pop("--adapter_dir"), demo_flags.pop("--adapter_dir")
    assert readme_flags and all(demo_flags.get(k) == v for k, v in readme_flags.items()), (readme_flags, demo_flags)


def test_the_override_command_runs(tmp_path):
    from sft_recipe.tiny import build_tiny

    build_tiny(REPO / ".tiny")  # the recipe reads .tiny/ (idempotent: a no-op once built)
    line = next(line for line in _code_lines() if "--config recipes/tiny_demo.yaml" in line)
    words = shlex.split(line)
    env = launch_env()
    while "=" in words[0]:  # leading VAR=value assignments
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    out = tmp_path / "override"
    words[words.index("--output_dir") + 1] = str(out)
    assert words[0] == ".venv/bin/accelerate"
    words[0] = str(Path(sys.executable).parent / "accelerate")  # the venv running the tests
    result = run_command(words, out, env=env)
    assert result.returncode == 0, result.output[-4000:]
    facts = result.facts
    assert facts["global_steps"] == 20 and facts["fsdp_version"] == 2  # --max_steps 20 overrode the recipe's 200
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4  # --lora_r 4 overrode the recipe's 8
    # The recipe evaluates at its end; FSDP2 used to leave a unit unsharded there and the report said CHANGED.
    assert facts["eval_losses"] and "frozen weights unchanged" in result.output


def test_help_lists_the_flags():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, env=launch_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--lora_r", "--chat_template_format", "--use_4bit_quantization", "--max_length", "--config",
                 "--defer_push_to_hub"):
        assert flag in proc.stdout


def test_files_section_matches_the_repository():
    section = README.split("## 9. Files", 1)[1]
    named = set()
    for line in section.splitlines():
        if line.startswith("- "):
            named |= set(re.findall(r"`([^`]+)`", line.split(" — ")[0]))
    for path in named:
        assert (REPO / path).exists(), f"README names {path}, which does not exist"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    tops = {p.split("/")[0] + ("/" if "/" in p else "") for p in tracked} - {".gitignore", "README.md", "pytest.ini"}
    tops |= {"sft_recipe/" + p.split("/")[1] for p in tracked if p.startswith("sft_recipe/") and
             not p.endswith("__init__.py")}
    tops -= {"sft_recipe/", "scripts/"}
    described = {n.rstrip("/") for n in named} | {n.split("/")[0] for n in named}
    missing = sorted(t for t in tops if t.rstrip("/") not in described)
    assert not missing, f"README's file list does not describe: {missing}"


def test_the_memory_plan_commands_run_offline():
    lines = [line.split("#")[0].strip() for line in _code_lines() if "-m sft_recipe.plan" in line]
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        assert words[0] == ".venv/bin/python"
        proc = subprocess.run([sys.executable, *words[1:]], cwd=REPO, env=launch_env(cpu_switch=False),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode in (0, 3), proc.stderr[-3000:]  # 3: the plan says it does not fit
        assert "72-80" in proc.stdout if "--guide" in words else "memory plan" in proc.stdout


def test_demo_script_runs_the_readme_merge_command():
    merge = next(line for line in _code_lines() if line.startswith("python merge_adapter.py"))
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert merge.split("--adapter_dir")[0] in demo and "--adapter_dir \"$OUTPUT_DIR\"" in demo
