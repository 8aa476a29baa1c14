"""Dataset formats: recognise them from their columns and convert each, once, into a shape TRL trains natively.

TRL's SFTTrainer itself understands three shapes: a text column (language modeling), `messages` (the chat template
is applied, optionally with assistant-only loss) and `prompt`/`completion`, standard or conversational (loss on the
completion only). ShareGPT and Alpaca rows, the shapes people bring from axolotl and LLaMA-Factory, are converted
into one of those, so that the masking and the chat template stay TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

from sft_recipe.errors import ConfigError

KNOWN_ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's own role names. Other names (bot, model, ...) are mapped with --dataset_role_map.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
# Role names seen in the wild, offered in the fix of an "unknown role" error.
LIKELY_ROLE = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
               "chatbot": "assistant", "ai": "assistant", "question": "user", "answer": "assistant"}


@dataclass(frozen=True)
class Format:
    name: str
    columns: tuple[str, ...]  # required; the text format's column is --dataset_text_field
    becomes: str  # what TRL is given, for the one-line note


FORMATS = {
    "messages": Format("messages", ("messages",), "`messages`: TRL applies the chat template"),
    "prompt_completion": Format("prompt_completion", ("prompt", "completion"),
                                "`prompt`/`completion` as they are: TRL trains on the completion only"),
    "sharegpt": Format("sharegpt", ("conversations",),
                       "`messages` (from/value -> role/content, roles mapped): TRL applies the chat template"),
    "alpaca": Format("alpaca", ("instruction", "output"),
                     "conversational `prompt` (instruction + input as the user turn) and `completion` (output as "
                     "the assistant turn): TRL trains on the completion only"),
    "text": Format("text", (), "the text column as it is: every token trained"),
}
FORMAT_CHOICES = ("auto", *FORMATS)


def parse_mapping(flag: str, value: str) -> tuple[dict[str, str], list[str]]:
    """'a=b,c=d' -> {'a': 'b', 'c': 'd'}, with a problem per malformed entry."""
    mapping: dict[str, str] = {}
    problems = []
    for entry in (e.strip() for e in (value or "").split(",")):
        if not entry:
            continue
        source, eq, target = (s.strip() for s in entry.partition("="))
        if not eq or not source or not target:
            problems.append(f"--{flag} '{value}': entry '{entry}' is not `name=new_name`. Example: "
                            f"--{flag} {'human=user,bot=assistant' if 'role' in flag else 'question=prompt'}.")
        else:
            mapping[source] = target
    return mapping, problems


def role_map(data_args, fmt: str) -> tuple[dict[str, str], list[str]]:
    """Role name -> one of KNOWN_ROLES: the format's own names, then the user's --dataset_role_map on top."""
    mapping, problems = parse_mapping("dataset_role_map", data_args.dataset_role_map)
    for source, target in mapping.items():
        if target not in KNOWN_ROLES:
            problems.append(f"--dataset_role_map {source}={target}: '{target}' is not a role the chat templates "
                            f"know; map to one of {', '.join(KNOWN_ROLES)}.")
    roles = {r: r for r in KNOWN_ROLES}
    if fmt == "sharegpt":
        roles.update(SHAREGPT_ROLES)
    roles.update(mapping)
    return roles, problems


def rename_columns(dataset, split: str, data_args):
    """Apply --dataset_column_map (e.g. `dialog=conversations`) so that detection sees the canonical names."""
    mapping, problems = parse_mapping("dataset_column_map", data_args.dataset_column_map)
    columns = dataset.column_names
    mapping = {s: t for s, t in mapping.items() if s != t}
    for source, target in mapping.items():
        if source not in columns:
            problems.append(f"--dataset_column_map {source}={target}: split '{split}' has no column '{source}' "
                            f"(columns: {columns}).")
        elif target in columns and target not in mapping:
            problems.append(f"--dataset_column_map {source}={target}: split '{split}' already has a column "
                            f"'{target}'. Fix: map it away too, or drop one of the two.")
    if problems:
        raise ConfigError(problems)
    return dataset.rename_columns(mapping) if mapping else dataset


def detect_format(columns: list[str], split: str, text_field: str, override: str = "auto") -> tuple[str, str]:
    """(format name, a note saying how it was found and what TRL is given). Raises ConfigError."""
    structured = [name for name, f in FORMATS.items() if f.columns and all(c in columns for c in f.columns)]
    if override != "auto":
        required = FORMATS[override].columns or (text_field,)
        missing = [c for c in required if c not in columns]
        if missing:
            raise ConfigError([f"--dataset_format {override}: split '{split}' has no column(s) {missing} "
                               f"(columns: {columns}). Fix: --dataset_column_map <yours>={missing[0]}, or another "
                               "--dataset_format."])
        return override, f"format '{override}' (--dataset_format) -> {FORMATS[override].becomes}."
    if len(structured) > 1:
        raise ConfigError([f"split '{split}': the columns {columns} fit several formats ({', '.join(structured)}). "
                           f"Fix: --dataset_format {structured[0]} (or {', '.join(structured[1:])}), or drop the "
                           "other columns."])
    if structured:
        fmt = structured[0]
        ignored = f"; text column `{text_field}` ignored" if text_field in columns else ""
        found = "/".join(f"`{c}`" for c in FORMATS[fmt].columns)
        return fmt, f"format '{fmt}' detected from {found}{ignored} -> {FORMATS[fmt].becomes}."
    if text_field in columns:
        return "text", (f"format 'text' detected from `{text_field}` (--dataset_text_field) -> "
                        f"{FORMATS['text'].becomes}.")
    raise ConfigError([f"split '{split}': neither a `messages` column nor the text column `{text_field}` "
                       "(--dataset_text_field), nor the columns of another known format (prompt/completion, "
                       f"conversations, instruction/output). Columns: {columns}. Fix: --dataset_text_field <column>, "
                       "or --dataset_column_map <yours>=messages|prompt|completion|conversations."])


def is_conversational(fmt: str, first_row: dict | None = None) -> bool:
    """Whether TRL will apply the chat template: always for chat formats, for prompt/completion when they are lists."""
    if fmt == "prompt_completion":
        return first_row is not None and isinstance(first_row.get("prompt"), list)
    return fmt in ("messages", "sharegpt", "alpaca")


def _turns(messages, roles: dict[str, str], role_key: str, content_key: str) -> list[dict]:
    """role/content under their canonical names, roles mapped; other keys of a message (name, ...) kept."""
    turns = []
    for m in messages:
        role, content = m.get(role_key, m.get("role")), m.get(content_key, m.get("content"))
        rest = {k: v for k, v in m.items() if k not in (role_key, content_key, "role", "content")}
        turns.append({**rest, "role": roles.get(role, role), "content": content})
    return turns


def convert_row(row: dict, fmt: str, roles: dict[str, str], text_field: str, bos: str | None = None) -> dict:
    """One row in the shape TRL trains on. Used by `datasets.map` for the conversion and by the row checks, so that
    what is checked is exactly what is trained."""
    if fmt == "text":
        text = row[text_field]
        return {text_field: bos + text if bos and not text.startswith(bos) else text}
    if fmt == "messages":
        return {"messages": _turns(row["messages"], roles, "role", "content")}
    if fmt == "sharegpt":
        return {"messages": _turns(row["conversations"], roles, "from", "value")}
    if fmt == "alpaca":
        extra = row.get("input")
        user = row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        system = row.get("system")
        prompt = ([{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else [])
        return {"prompt": prompt + [{"role": "user", "content": user}],
                "completion": [{"role": "assistant", "content": row["output"]}]}
    if isinstance(row["prompt"], list):  # conversational prompt/completion
        return {"prompt": _turns(row["prompt"], roles, "role", "content"),
                "completion": _turns(row["completion"], roles, "role", "content")}
    return {"prompt": row["prompt"], "completion": row["completion"]}


def convert(dataset, fmt: str, roles: dict[str, str], text_field: str, bos: str | None = None):
    """The whole split in TRL's shape: one `datasets.map` (cached by fingerprint for file-backed data)."""
    kept = ["messages"] if fmt in ("messages", "sharegpt") else [text_field] if fmt == "text" else \
        ["prompt", "completion"]
    if fmt == "text" and not bos:  # nothing to rewrite: keep the column as it is
        return dataset.select_columns(kept)
    if fmt == "messages" and all(source == target for source, target in roles.items()):
        return dataset.select_columns(kept)  # roles already canonical: no rewrite needed
    return dataset.map(convert_row, fn_kwargs={"fmt": fmt, "roles": roles, "text_field": text_field, "bos": bos},
                       remove_columns=dataset.column_names, desc=f"Converting {fmt} rows")
