"""The README and docs/ are a path the tests run: their commands run (here or in .ci/run), their links resolve, and
the README's file list is the repo's."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, launch_env, run_command

README = (REPO / "README.md").read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))  # the reference pages the README links to
PAGES = {REPO / "README.md": README} | {path: path.read_text() for path in DOCS}


def _code_lines(*texts: str) -> list[str]:
    """The lines inside the ``` blocks of texts: of README.md and every docs/*.md unless texts are given."""
    lines, inside = [], False
    for text in texts or PAGES.values():
        for line in text.splitlines():
            if line.startswith("```"):
                inside = not inside
                continue
            if inside:
                lines.append(line)
        assert not inside, "a ``` block is left open"
    return lines


def _prose(text: str) -> str:
    """text without its ``` blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (lower case, punctuation dropped, spaces to -)."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", _prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_two_fresh_machine_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("make demo", "make test"):
        assert any(line.startswith(command) for line in _code_lines(README))  # in the README itself
        assert command in ci


def test_demo_script_runs_the_readme_evaluate_command():
    """The README's evaluate command is the one the demo runs (same flags and values, the adapter folder aside)."""
    commands = [c for text in PAGES.values() for c in re.findall(r"`(python -m sft_recipe\.evaluate [^`]+)`", text)]
    assert len(commands) == 1, commands
    readme = shlex.split(commands[0])
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
    lines = [line for line in _code_lines(README) if "--config recipes/tiny_demo.yaml" in line]
    assert len(lines) == 1, lines  # the smallest run, in the README's first screen
    words = shlex.split(lines[0])
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
    facts = result.record
    # --max_steps 20 overrode the recipe's 200
    assert facts["training"]["global_steps"] == 20 and facts["distribution"]["fsdp_version"] == 2
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4  # --lora_r 4 overrode the recipe's 8
    # The recipe evaluates at its end; FSDP2 used to leave a unit unsharded there and the report said CHANGED.
    assert facts["training"]["eval_losses"] and "frozen weights unchanged" in result.output


def test_help_lists_the_flags():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, env=launch_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--lora_r", "--chat_template_format", "--use_4bit_quantization", "--max_length", "--config",
                 "--defer_push_to_hub"):
        assert flag in proc.stdout


def test_files_section_matches_the_repository():
    parts = re.split(r"^## \d+\. Files$", README, flags=re.M)
    assert len(parts) == 2, "the README has one numbered Files section"
    section = parts[1]
    assert not re.search(r"^#", section, flags=re.M), "Files is the README's last section"
    named = set()
    for line in section.splitlines():
        if line.startswith("- "):
            named |= set(re.findall(r"`([^`]+)`", line.split(" — ")[0]))
    for path in named:
        assert (REPO / path).exists(), f"README names {path}, which does not exist"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    tops = {p.split("/")[0] + ("/" if "/" in p else "") for p in tracked} - {".gitignore", "README.md"}
    # Every module of the library, each described by its own line or by the line of the folder that holds it.
    tops |= {p for p in tracked if p.startswith("sft_recipe/") and p.endswith(".py")
             and not p.endswith("__init__.py")}
    tops -= {"sft_recipe/", "scripts/"}
    described = {n.rstrip("/") for n in named}
    def is_described(t: str) -> bool:  # named itself, inside a named folder, or a top folder with a named file
        return any(t.rstrip("/") == n or t.startswith(n + "/") or (t.endswith("/") and n.startswith(t))
                   for n in described)

    missing = sorted(t for t in tops if not is_described(t))
    assert not missing, f"README's file list does not describe: {missing}"


def test_the_memory_plan_commands_run_offline():
    lines = [line.split("#")[0].strip() for line in _code_lines() if "-m sft_recipe.plan" in line]
    assert len(lines) == 2 and sum("--guide" in line for line in lines) == 1, lines  # in docs/memory-and-speed.md
    for line in lines:
        words = shlex.split(line)
        assert words[0] == ".venv/bin/python"
        proc = subprocess.run([sys.executable, *words[1:]], cwd=REPO, env=launch_env(cpu_switch=False),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode in (0, 3), proc.stderr[-3000:]  # 3: the plan says it does not fit
        assert "72-80" in proc.stdout if "--guide" in words else "memory plan" in proc.stdout


def test_demo_script_runs_the_readme_merge_command():
    merges = [line for line in _code_lines() if line.startswith("python merge_adapter.py")]
    assert len(merges) == 1, merges  # in docs/guide-caveats.md
    merge = merges[0]
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert merge.split("--adapter_dir")[0] in demo and "--adapter_dir \"$OUTPUT_DIR\"" in demo


def test_every_relative_link_points_to_a_file_that_exists():
    assert DOCS, "docs/ holds the README's reference pages"
    checked, broken = 0, []
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert checked and not broken, broken


def test_the_readme_links_every_reference_page():
    linked = {(REPO / target.partition("#")[0]).resolve()
              for target in re.findall(r"\]\((docs/[^)\s]+)\)", _prose(README))}
    unlinked = sorted(str(page.relative_to(REPO)) for page in DOCS if page not in linked)
    assert DOCS, "docs/ holds the README's reference pages"
    assert not unlinked, f"README.md does not link {unlinked}"
