"""The accelerate YAML a run was launched with, read once before any weight loads, the way accelerate reads it.

`accelerate launch` turns the YAML into environment variables for the ranks (config/launch_env.py reads those), but
only the keys it knows: a misspelt key (`fsdp_sharding_stratgy`) is dropped in silence and the run trains with the
default the user meant to change. So the ranks read the YAML itself: its path is on the launcher's own command line
(`--config_file`, else accelerate's default config), and the launcher is this process's parent (torchrun's agent
runs inside `accelerate launch`, and the one-process launcher starts the script directly).

Which keys and values are known is asked of the installed accelerate, never listed here:
- the top level: the fields of its `ClusterConfig` dataclass (and the two legacy keys its `process_config` rewrites);
- a section (`fsdp_config`, `deepspeed_config`, ...): accelerate copies each key onto its launch parser's argument of
  that name (`fsdp_config` keys get an `fsdp_` prefix, `fp8_config` `fp8_`, `dynamo_config` `dynamo_`:
  `_validate_launch_command`), so a key is known when `launch_command_parser()` has that destination, and a value is
  accepted when it is one of that argument's choices and converts with its type.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SECTION_PREFIX = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}  # accelerate's mapping
LEGACY_TOP_KEYS = ("fp16", "dynamo_backend")  # rewritten by accelerate's BaseConfig.process_config
BOOL_DEFAULTS = ("true", "false")  # parser defaults of the arguments accelerate reads with str_to_bool


@dataclass(frozen=True)
class LauncherYaml:
    """The YAML accelerate read for this run (`path` None: it read none), with how it was found."""
    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    found_by: str = ""


def _parser():
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def launcher_arguments(parent_argv: Sequence[str], script: str, parent_cwd: Path):
    """accelerate's own parse of the launcher's flags on `parent_argv` (the launcher's command line), or None when
    it is not an `accelerate launch` of `script`: the flags are the longest run of options before the script that
    accelerate's parser takes whole."""
    target = os.path.realpath(script)
    at = next((i for i, token in enumerate(parent_argv)
               if token.endswith(".py") and os.path.realpath(parent_cwd / token) == target), None)
    if at is None:
        return None
    parser = _parser()
    for start in range(at + 1):
        flags = list(parent_argv[start:at])
        if flags and not flags[0].startswith("-"):
            continue
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                args, unknown = parser.parse_known_args([*flags, parent_argv[at]])
            except SystemExit:  # argparse refuses this slice: it starts inside the interpreter's own options
                continue
        if not unknown and args.training_script == parent_argv[at]:
            return args
    return None


def _parent_command(pid: int) -> tuple[list[str], Path] | None:
    """The command line and working folder of process `pid`, from /proc (Linux)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None
    return [a.decode(errors="replace") for a in argv if a], cwd


def find_launcher_yaml(accelerate_launched: bool, script: str, parent: tuple[list[str], Path] | None = None,
                       ) -> LauncherYaml | None:
    """The YAML this run was launched with; None when `accelerate launch` did not start it (python, torchrun). A
    launcher whose command line cannot be read is said in a WARNING: the keys then go unchecked."""
    if not accelerate_launched:  # python or torchrun: no accelerate YAML
        return None
    parent = parent if parent is not None else _parent_command(os.getppid())
    args = launcher_arguments(*parent[:1], script, parent[1]) if parent else None
    if args is None:
        logger.warning("the accelerate YAML of this run was not checked: the launcher's command line (parent process "
                       "%d) could not be read as `accelerate launch ... %s`. Misspelt keys in it would be ignored by "
                       "accelerate; check it with `python -m sft_recipe.config.launcher_yaml CONFIG.yaml`.",
                       os.getppid(), Path(script).name)
        return None
    if args.config_file:
        path, found_by = parent[1] / args.config_file, "--config_file"
    else:
        from accelerate.commands.config.config_args import default_config_file

        if not os.path.isfile(default_config_file) or args.cpu:  # accelerate's own condition
            return LauncherYaml(None, {}, "no config file")
        path, found_by = Path(default_config_file), "accelerate's default config"
    return LauncherYaml(path, read_yaml(path), found_by)


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        values = yaml.safe_load(f) or {}
    return values if isinstance(values, dict) else {}


def _nearest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""


def _value_problem(where: str, value: Any, action) -> str | None:
    """Whether accelerate takes `value` for its launch argument `action` (its choices, its type, its booleans)."""
    from accelerate.utils.environment import str_to_bool

    text = str(value).lower() if isinstance(value, bool) else str(value)
    if action.choices is not None and text not in [str(c) for c in action.choices]:
        return f"{where}: {value!r} is not a value accelerate takes. Fix: one of {', '.join(map(str, action.choices))}."
    if action.type in (int, float):
        try:
            action.type(text)
        except ValueError:
            kind = "a whole number" if action.type is int else "a number"
            return f"{where}: {value!r} is not {kind}. Fix: {kind} (accelerate reads it with {action.type.__name__})."
    if action.default in BOOL_DEFAULTS:
        try:
            str_to_bool(text)
        except ValueError:
            return f"{where}: {value!r} is not a boolean. Fix: true or false."
    return None


def yaml_problems(values: Mapping[str, Any], path: Path | str) -> list[str]:
    """Every key of the YAML accelerate would drop or refuse, and every value its launcher would not take, each with
    the nearest known key or the values it takes."""
    from accelerate.commands.config.config_args import ClusterConfig

    where = Path(path).name
    if str(values.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        logger.warning("%s: compute_environment %s: only LOCAL_MACHINE configs are checked key by key.", where,
                       values.get("compute_environment"))
        return []
    top_known = sorted(set(ClusterConfig.__dataclass_fields__) | set(LEGACY_TOP_KEYS))
    actions = {a.dest: a for a in _parser()._actions}
    problems = []
    for key, value in values.items():
        if key not in top_known:
            problems.append(f"{where}: `{key}` is not a key accelerate knows (it refuses the file with \"unknown "
                            f"keys\").{_nearest(key, top_known)} Fix: correct or remove it.")
        elif key == "mixed_precision" and value is not None:
            problems.append(_value_problem(f"{where}: mixed_precision", value, actions["mixed_precision"]))
        elif key in ("num_processes", "num_machines", "machine_rank", "main_process_port") and value is not None:
            problems.append(_value_problem(f"{where}: {key}", value, actions[key]))
        elif isinstance(value, dict):
            problems += _section_problems(where, key, value, actions)
    return [p for p in problems if p]


def _section_problems(where: str, section: str, values: Mapping[str, Any], actions: Mapping[str, Any]) -> list:
    prefix = SECTION_PREFIX.get(section, "")
    known_here = sorted(d for d in actions if d.startswith(prefix)) if prefix else sorted(actions)
    problems = []
    for key, value in values.items():
        dest = key if not prefix or key.startswith(prefix.rstrip("_")) else prefix + key
        if dest not in actions:
            problems.append(f"{where}: `{section}.{key}` is not a key accelerate knows: accelerate drops it in silence "
                            f"and the run would train with that setting's default.{_nearest(dest, known_here)} Fix: "
                            "correct or remove it.")
        elif value is not None:
            problems.append(_value_problem(f"{where}: {section}.{key}", value, actions[dest]))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sft_recipe.config.launcher_yaml CONFIG.yaml ...`: check accelerate YAMLs without launching."""
    import sys

    from sft_recipe.errors import ConfigError

    paths = list(sys.argv[1:] if argv is None else argv)
    problems = [p for path in paths for p in yaml_problems(read_yaml(Path(path)), path)]
    if problems:
        print(ConfigError(problems), file=sys.stderr)
        return 2
    print(f"{len(paths)} accelerate config(s) OK: every key and value is one accelerate {_accelerate_version()} takes")
    return 0


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


if __name__ == "__main__":
    raise SystemExit(main())
