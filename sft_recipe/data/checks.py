"""Every row checked before any weight is loaded: what would otherwise be a traceback mid-training, or silently
wrong training (an unknown role rendered verbatim, a conversation with nothing to learn), is listed here, each
problem with its file or split, its row or line, and the fix.

A row is checked in the shape it will be trained in (`data_formats.convert_row`), and chat rows are rendered with
the tokenizer's chat template, so a template that raises or renders nothing is caught here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from sft_recipe.data.formats import KNOWN_ROLES, LIKELY_ROLE, convert_row
from sft_recipe.errors import ConfigError

MAX_LISTED = 20  # problems shown in one error; the rest are counted
DROP_HINT = "--drop_bad_rows True to train without such rows"


@dataclass
class SplitCheck:
    bad_rows: list[int] = field(default_factory=list)  # dataset indices
    problems: list[str] = field(default_factory=list)  # one per bad row (or malformed line), with its location
    unknown_roles: set[str] = field(default_factory=set)


def scan_json_lines(path: str) -> tuple[list[int], list[tuple[int, str]]]:
    """(line numbers of the rows, [(line, why)] of lines that are not UTF-8 or not a JSON object). Blank lines are
    no rows, as for `datasets`' JSON reader. A gzip file is read decompressed."""
    from sft_recipe.data.files import decode_line, open_binary

    rows, bad = [], []
    with open_binary(path) as f:
        for number, raw in enumerate(f, start=1):
            line, not_text = decode_line(raw)
            if not_text:
                bad.append((number, not_text))
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                bad.append((number, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            if isinstance(value, dict):
                rows.append(number)
            else:
                bad.append((number, f"a JSON {type(value).__name__}, not an object of columns"))
    return rows, bad


def _kind(value) -> str:
    """How a wrong value reads in an error: `null`, `a number (5)`, `a list ([...])`."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), f"a {type(value).__name__}")
    shown = repr(value) if len(repr(value)) <= 30 else repr(value)[:27] + "..."
    return f"{kind} ({shown})"


def _turn_problems(turns, column: str, role_key: str, content_key: str, roles: dict[str, str],
                   unknown: set[str]) -> list[str]:
    if not isinstance(turns, list):
        return [f"`{column}` is {_kind(turns)}, not a list of messages"]
    if not turns:
        return [f"`{column}` is an empty conversation"]
    problems = []
    for n, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            problems.append(f"`{column}` message {n} is {_kind(turn)}, not an object with `{role_key}` and "
                            f"`{content_key}`")
            continue
        role = turn.get(role_key, turn.get("role"))
        content = turn.get(content_key, turn.get("content"))
        if role is None:
            problems.append(f"`{column}` message {n} has no `{role_key}`")
        elif roles.get(role) not in KNOWN_ROLES:
            known = "" if any("unknown role" in p for p in problems) else f" (known: {', '.join(sorted(roles))})"
            unknown.add(str(role))
            problems.append(f"`{column}` message {n} has the unknown role {role!r}{known}")
        if not isinstance(content, str):
            problems.append(f"`{column}` message {n} has `{content_key}` {_kind(content)}; it must be a string"
                            if content_key in turn or "content" in turn else
                            f"`{column}` message {n} has no `{content_key}`")
    return problems


def _last_role(turns: list[dict]) -> str | None:
    return turns[-1]["role"] if turns else None


def structure_problems(row: dict, fmt: str, roles: dict[str, str], text_field: str, assistant_only_loss: bool,
                       conversational: bool, unknown: set[str]) -> list[str]:
    """What is wrong with one raw row, before any template sees it."""
    if fmt == "text":
        text = row.get(text_field)
        if not isinstance(text, str):
            return [f"`{text_field}` is {_kind(text)}; it must be a string"]
        return [] if text.strip() else [f"`{text_field}` is empty: nothing to train on"]
    if fmt in ("messages", "sharegpt"):
        column, keys = ("messages", ("role", "content")) if fmt == "messages" else ("conversations", ("from", "value"))
        problems = _turn_problems(row.get(column), column, *keys, roles, unknown)
        if not problems and assistant_only_loss:
            last = roles.get(_last_role(convert_row(row, fmt, roles, text_field)["messages"]))
            if last != "assistant":
                problems.append(f"the conversation ends with a {last!r} turn, not an assistant one: with "
                                "--assistant_only_loss True nothing after the last assistant turn is trained")
        return problems
    if fmt == "alpaca":
        problems = [f"`{c}` is {_kind(row.get(c))}; it must be a string" for c in ("instruction", "output")
                    if not isinstance(row.get(c), str)]
        problems += [f"`{c}` is empty" for c in ("instruction", "output")
                     if isinstance(row.get(c), str) and not row[c].strip()]
        for optional in ("input", "system"):
            if row.get(optional) is not None and not isinstance(row[optional], str):
                problems.append(f"`{optional}` is {_kind(row[optional])}; it must be a string or absent")
        return problems
    # prompt/completion: one split uses one form, strings or lists of messages
    if conversational:
        problems = [p for c in ("prompt", "completion")
                    for p in _turn_problems(row.get(c), c, "role", "content", roles, unknown)]
        if not problems and roles.get(row["completion"][-1]["role"]) != "assistant":
            problems.append(f"the completion ends with a {row['completion'][-1]['role']!r} turn, not an assistant "
                            "one: the completion is what is trained")
        return problems
    problems = [f"`{c}` is {_kind(row.get(c))}; this split's prompt/completion are strings (its first row)"
                for c in ("prompt", "completion") if not isinstance(row.get(c), str)]
    if not problems and not row["completion"].strip():
        problems.append("`completion` is empty: nothing to train on")
    return problems


def render_problem(converted: dict, tokenizer, chat_template: str | None = None,
                   assistant_only_loss: bool = False) -> str | None:
    """Render a chat row with the chat template TRL will use (`chat_template`, else the tokenizer's): a template
    error, an empty rendering, or (--assistant_only_loss) no assistant token for TRL's mask."""
    messages = converted.get("messages") or (converted["prompt"] + converted["completion"])
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template)
    except Exception as e:  # jinja2 raise_exception, a missing key the template reads, ...
        return f"the chat template fails on it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not text.strip():
        return "the chat template renders it to nothing"
    if assistant_only_loss:
        from sft_recipe.data.chat_templates import assistant_tokens_problem

        return assistant_tokens_problem(messages, tokenizer, chat_template)
    return None


def check_split(dataset, fmt: str, where: Callable[[int], str], roles: dict[str, str], text_field: str, tokenizer,
                assistant_only_loss: bool = False, conversational: bool = False,
                chat_template: str | None = None) -> SplitCheck:
    """Every row of one split; one problem line per bad row (its problems joined). `chat_template`: the one TRL
    renders with in place of the tokenizer's (--assistant_only_loss with a template TRL patches), else None."""
    result = SplitCheck()
    render = conversational and getattr(tokenizer, "chat_template", None)
    for i, row in enumerate(dataset):
        problems = structure_problems(row, fmt, roles, text_field, assistant_only_loss, conversational,
                                      result.unknown_roles)
        if not problems and render:
            problem = render_problem(convert_row(row, fmt, roles, text_field), tokenizer, chat_template,
                                     assistant_only_loss)
            problems = [problem] if problem else []
        if problems:
            result.bad_rows.append(i)
            result.problems.append(f"{where(i)}: {'; '.join(problems)}")
    return result


def by_position(problems: list[str]) -> list[str]:
    """Problems of one split in file order (malformed lines are found before the rows are read)."""
    def position(problem: str) -> int:
        found = re.search(r" (?:line|row) (\d+):", problem)
        return int(found.group(1)) if found else 0
    return sorted(problems, key=position)


def role_fix(unknown: set[str]) -> str:
    """The --dataset_role_map that would fix the unknown roles seen, guessing the usual names."""
    pairs = ",".join(f"{r}={LIKELY_ROLE.get(r.lower(), 'user|assistant')}" for r in sorted(unknown))
    return f"--dataset_role_map {pairs}"


def raise_problems(problems: list[str], bad_rows: int, total_rows: int, unknown_roles: set[str]) -> None:
    """One ConfigError listing the first MAX_LISTED problems, the count of the rest, and the fixes."""
    shown = problems[:MAX_LISTED]
    more = len(problems) - len(shown)
    fixes = []
    if unknown_roles:
        fixes.append(f"map the unknown roles with {role_fix(unknown_roles)}")
    fixes += ["correct the rows", DROP_HINT]
    listed = shown + ([f"... and {more} more problem(s) not listed"] if more else [])
    summary = (f"{bad_rows} bad row(s) of {total_rows}. Fix: {'; or '.join(fixes)}.")
    raise ConfigError(listed + [summary])
