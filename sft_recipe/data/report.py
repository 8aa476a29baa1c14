"""The data report: what will be trained, measured before any weight is loaded, and the preview of N examples.

Examples are tokenized by TRL's own dataset preparation (`SFTTrainer._prepare_dataset`, run without truncation or
packing: `tokenize_like_trl`), once: the report reads those rows and the trainer is given them (TRL then only cuts
or packs them), so lengths and loss masks are the trainer's, not a re-implementation; the cut at `max_length` and
the packing are measured on them (packing with TRL's `pack_dataset`), a batch of rows at a time. Once the trainer
has prepared its data, `confirm` compares it with the prediction and records the trainer's own counts.

The field names of data_report.json are the dataclasses below and nowhere else.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPORT_FILE = "data_report.json"
CUT_WARNING_SHARE = 0.05  # warn when more than this share of examples is longer than max_length
LOSS_MARK = ("⟦", "⟧")  # the preview puts loss-carrying text between these
IGNORE = -100
logger = logging.getLogger(__name__)


@dataclass
class SplitReport:
    format: str
    rows_read: int
    rows_dropped: int  # by --drop_bad_rows
    rows: int
    tokens_min: int
    tokens_median: float
    tokens_max: int
    tokens_total: int  # before the cut at max_length
    examples_cut_share: float  # longer than max_length
    tokens_cut_share: float  # lost at max_length (0 when packing splits long examples instead)
    examples_left_without_loss: int  # TRL drops examples whose loss tokens were all cut
    tokens_trained: int  # what the model sees, after the cut
    loss_tokens: int  # of tokens_trained, those with a label
    loss_token_share: float
    packed_rows: int | None  # with packing
    packing_efficiency: float | None  # tokens per packed row / max_length
    eos_with_loss_share: float | None  # of examples ending in EOS, those whose EOS carries loss (stop learned)
    held_out_of: str | None = None  # "train: --eval_split_size 0.05, seed 42" for a test split carved from train


@dataclass
class SourceReport:
    """One source of a mixture (several --dataset_name sources): what was read of it and what the mixture took."""

    name: str
    format: str
    rows_read: int  # its training rows, malformed lines included
    rows_dropped: int  # by --drop_bad_rows
    train_rows: int  # taken into the mixed training rows (--dataset_proportions)
    train_share: float  # of the mixed training rows, before --eval_split_size
    test_rows: int | None  # its test split, mixed whole
    loss_tokens: int | None = None  # of the mixture's train split (after the cut), those of this source's rows


@dataclass
class DataReport:
    max_length: int | None
    packing: bool
    packing_strategy: str | None
    truncation_mode: str
    cut_warning_share: float
    splits: dict[str, SplitReport]
    warnings: list[str] = field(default_factory=list)
    trainer_check: dict | None = None  # the trainer's own token and loss-token counts for the train split
    sources: list[SourceReport] | None = None  # a mixture's sources, in --dataset_name order

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, fields: dict) -> DataReport:
        sources = [SourceReport(**s) for s in fields["sources"]] if fields.get("sources") else None
        return cls(**{**fields, "splits": {role: SplitReport(**s) for role, s in fields["splits"].items()},
                      "sources": sources})

    def render(self, output_dir: str | None = None) -> str:
        where = f" (written to {Path(output_dir) / REPORT_FILE})" if output_dir else ""
        lines = [f"data report{where}:"]
        for role, s in self.splits.items():
            cut = (f"over max_length {self.max_length}: {s.examples_cut_share:.1%} of examples, "
                   f"{s.tokens_cut_share:.1%} of tokens cut" if self.max_length else "no max_length")
            held = f", held out of {s.held_out_of}" if s.held_out_of else ""
            lines.append(f"  {role}: {s.rows} rows ({s.format}, {s.rows_dropped} dropped{held}) | tokens per example "
                         f"min {s.tokens_min} / median {s.tokens_median:g} / max {s.tokens_max} | {cut}")
        for source in self.sources or []:
            lines.append(f"  source {source.name}: {source.train_rows} of {source.rows_read} train rows "
                         f"({source.train_share:.1%} of the mixture, {source.format}, {source.rows_dropped} dropped)"
                         + (f", {source.test_rows} test rows" if source.test_rows is not None else "")
                         + (f", {source.loss_tokens} tokens carrying loss" if source.loss_tokens is not None else ""))
        train = self.splits.get("train")
        if train:
            packing = (f"packing ({self.packing_strategy}): {train.packed_rows} rows, "
                       f"{train.packing_efficiency:.1%} full" if self.packing else "packing off")
            lines.append(f"  train: {packing} | tokens carrying loss: {train.loss_token_share:.1%} "
                         f"({train.loss_tokens} of {train.tokens_trained})")
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def tokenize_like_trl(dataset, tokenizer, training_args, chat_template: str | None = None, num_proc: int | None = None,
                      name: str = "train"):
    """Rows -> input_ids + labels exactly as SFTTrainer prepares them, but uncut and unpacked, without a model.

    `_prepare_dataset` reads three trainer attributes, given here as SFTTrainer sets them: the tokenizer, the
    completion-only switch (on for prompt/completion rows unless the flag says otherwise) and the chat template
    override (`chat_template`: TRL's training version of a template without generation markers, under
    --assistant_only_loss; `PreparedData.chat_template`). The result is what the trainer is given: TRL sees
    `input_ids` and `labels` and only cuts (or packs) them, so the rows are tokenized once."""
    from trl import SFTTrainer

    from sft_recipe.compat import without_rank_barriers

    if "input_ids" in dataset.column_names:  # a mixture of sources of different shapes, tokenized per source
        return dataset
    args = copy.copy(training_args)
    args.max_length, args.packing, args.shuffle_dataset = None, False, False
    args.dataset_num_proc = num_proc
    first = dataset[0]
    completion_only = training_args.completion_only_loss
    if completion_only is None:
        completion_only = "prompt" in first and "completion" in first
    trainer = SimpleNamespace(_tokenizer=tokenizer, completion_only_loss=completion_only, chat_template=chat_template)
    with without_rank_barriers():  # one process prepares; the recipe orders the ranks (data/prepared_copy.py)
        return SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, False, None, name)


BATCH_ROWS = 256  # rows read at a time: the report holds this many examples' tokens (at 4,000 tokens each, 8 MB
#                   per int64 column), whatever the number of rows


def arrow_files(dataset) -> list[str] | None:
    """The Arrow files a split is read from, when it is those files' rows as they stand (no row selection on top),
    else None (rows in memory)."""
    files = [f["filename"] for f in dataset.cache_files]
    if not files or dataset._indices is not None or any(not os.path.isfile(f) for f in files):
        return None
    return files


def token_batches(dataset, columns: list[str]):
    """The split's `columns`, a batch of rows at a time (Arrow tables). A split that is wholly its Arrow files is read
    from them as a stream, into memory freed batch by batch: reading it through the memory map would leave every
    page read resident in this process (file-backed RSS growing with the rows) until the split is dropped."""
    import pyarrow as pa

    files = arrow_files(dataset)
    if files is None:
        yield from dataset.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
        return
    rows = 0
    for path in files:
        with pa.OSFile(path) as source:
            for batch in pa.ipc.open_stream(source):
                rows += batch.num_rows
                yield pa.Table.from_batches([batch.select(columns)])
    if rows != len(dataset):  # files that are not this split's rows after all: what the split says
        raise RuntimeError(f"the split's Arrow files hold {rows} rows, the split {len(dataset)}")


def _example_stats(tokenized, limit: int | None, keep: str, eos_token_id) -> dict[str, np.ndarray]:
    """Per example: tokens, loss tokens kept by a cut at `limit` (`keep`: "all", "start" or "end"), whether it ends
    in EOS and whether that EOS carries loss, and the mixture source it came from (where rows are marked). Read
    through Arrow a batch at a time: per-example numbers only, never every token of the split at once."""
    import pyarrow.compute as pc

    from sft_recipe.data.mixture import SOURCE_COLUMN

    marked = SOURCE_COLUMN in tokenized.column_names
    parts: dict[str, list] = {"lengths": [], "loss_kept": [], "ends_in_eos": [], "eos_has_loss": [], "source": []}
    for batch in token_batches(tokenized, ["input_ids", "labels", *([SOURCE_COLUMN] if marked else [])]):
        if marked:
            parts["source"].append(np.asarray(batch[SOURCE_COLUMN], dtype=np.int64))
        lengths = np.asarray(pc.list_value_length(batch["input_ids"]), dtype=np.int64)
        ids = np.asarray(pc.list_flatten(batch["input_ids"]), dtype=np.int64)
        labels = np.asarray(pc.list_flatten(batch["labels"]), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        ends = starts + lengths
        loss_cum = np.concatenate([[0], np.cumsum(labels != IGNORE)])
        kept = lengths if keep == "all" or limit is None else np.minimum(lengths, limit)
        if keep == "end":
            loss_kept = loss_cum[ends] - loss_cum[ends - kept]
        else:
            loss_kept = loss_cum[starts + kept] - loss_cum[starts]
        last = np.maximum(ends - 1, 0)
        nonempty = lengths > 0
        parts["lengths"].append(lengths)
        parts["loss_kept"].append(loss_kept)
        parts["ends_in_eos"].append(nonempty & (ids[last] == eos_token_id) if len(ids) and eos_token_id is not None
                                    else np.zeros(len(lengths), dtype=bool))
        parts["eos_has_loss"].append(nonempty & (labels[last] != IGNORE) if len(labels)
                                     else np.zeros(len(lengths), dtype=bool))
    return {k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for k, v in parts.items()}


def measure_split(tokenized, fmt: str, rows_read: int, rows_dropped: int, training_args,
                  eos_token_id) -> tuple[SplitReport, list[int] | None]:
    """The split's report, and the loss tokens of each mixture source's rows (None: rows not marked by a source)."""
    limit = training_args.max_length
    packing, strategy = training_args.packing, training_args.packing_strategy
    splits_long = packing and strategy in ("bfd_split", "wrapped")  # long examples continue in another row
    if limit is None or splits_long:
        keep = "all"
    elif training_args.truncation_mode == "keep_end" and not packing:
        keep = "end"
    else:  # keep_start, and packing "bfd" (which keeps the start of a long example)
        keep = "start"
    stats = _example_stats(tokenized, limit, keep, eos_token_id)
    lengths, loss_kept = stats["lengths"], stats["loss_kept"]
    kept = lengths if keep == "all" else np.minimum(lengths, limit)
    without_loss = 0
    if not packing:  # TRL drops examples whose loss tokens were all cut off
        without_loss = int(((loss_kept == 0) & (lengths > 0)).sum())
        kept = np.where(loss_kept > 0, kept, 0)
    tokens_trained, loss_tokens = int(kept.sum()), int(loss_kept.sum())
    by_source = None
    if len(stats["source"]) == len(lengths) and len(lengths):
        by_source = np.bincount(stats["source"], weights=loss_kept).astype(np.int64).tolist()
    packed_rows = efficiency = None
    if packing:
        from trl.data_utils import pack_dataset

        # As the trainer calls it (same columns, processes): its packing then reads this one from the cache.
        packed_rows = len(pack_dataset(tokenized.select_columns(["input_ids", "labels"]), limit, strategy,
                                       {"num_proc": training_args.dataset_num_proc}))
        efficiency = tokens_trained / (packed_rows * limit) if packed_rows else 0.0
    eos_share = None
    if stats["ends_in_eos"].any():
        eos_share = float(stats["eos_has_loss"][stats["ends_in_eos"]].mean())
    total = int(lengths.sum())
    over = int((lengths > limit).sum()) if limit else 0
    cut = 0 if limit is None or splits_long else int((lengths - np.minimum(lengths, limit)).sum())
    return SplitReport(
        format=fmt, rows_read=rows_read, rows_dropped=rows_dropped, rows=len(lengths),
        tokens_min=int(lengths.min()) if len(lengths) else 0,
        tokens_median=float(np.median(lengths)) if len(lengths) else 0.0,
        tokens_max=int(lengths.max()) if len(lengths) else 0, tokens_total=total,
        examples_cut_share=over / len(lengths) if len(lengths) else 0.0,
        tokens_cut_share=cut / total if total else 0.0,
        examples_left_without_loss=without_loss, tokens_trained=tokens_trained, loss_tokens=loss_tokens,
        loss_token_share=loss_tokens / tokens_trained if tokens_trained else 0.0,
        packed_rows=packed_rows, packing_efficiency=efficiency, eos_with_loss_share=eos_share), by_source


def _warnings(report: DataReport) -> list[str]:
    warnings = []
    for role, s in report.splits.items():
        if report.max_length and s.examples_cut_share > report.cut_warning_share:
            lost = "continue in the next packed row" if s.tokens_cut_share == 0 else \
                f"lose {s.tokens_cut_share:.0%} of their tokens"
            warnings.append(f"{s.examples_cut_share:.0%} of the {role} examples are longer than max_length "
                            f"{report.max_length} and {lost} (longest: {s.tokens_max} tokens, median "
                            f"{s.tokens_median:g}). Fix: raise --max_seq_len (e.g. {int(s.tokens_max)}), or shorten "
                            "the examples.")
        if s.examples_left_without_loss:
            warnings.append(f"{s.examples_left_without_loss} {role} example(s) keep no loss-carrying token after the "
                            "cut at max_length; TRL drops them.")
        if s.loss_tokens == 0:
            warnings.append(f"no {role} token carries loss: nothing would be learned.")
        if s.eos_with_loss_share is not None and s.eos_with_loss_share < 1:
            warnings.append(f"the EOS ending {1 - s.eos_with_loss_share:.0%} of the {role} examples carries no "
                            "loss: the model would not learn to stop.")
    return warnings


def tokenized_splits(prepared, tokenizer, training_args) -> dict:
    """`prepared.tokenized`, tokenizing the splits first where nothing has (a `prepare()` result used directly)."""
    if not prepared.tokenized:
        prepared.tokenized = {role: tokenize_like_trl(dataset, tokenizer, training_args, prepared.chat_template,
                                                      name=role)
                              for role, dataset in prepared.datasets.items()}
    return prepared.tokenized


def measure(prepared, tokenizer, training_args) -> DataReport:
    """The report for every split of a `data.PreparedData`, read from its tokenized splits (`tokenized`)."""
    measured = {role: measure_split(tokenized, prepared.formats[role], prepared.rows_read[role],
                                    prepared.rows_dropped[role], training_args, tokenizer.eos_token_id)
                for role, tokenized in tokenized_splits(prepared, tokenizer, training_args).items()}
    splits = {role: split for role, (split, _) in measured.items()}
    sources = [SourceReport(**s) for s in prepared.mixture] if prepared.mixture else None
    by_source = measured["train"][1] if "train" in measured else None
    for n, source in enumerate(sources or []):
        if by_source is not None:  # a source whose rows were all cut away counts 0
            source.loss_tokens = by_source[n] if n < len(by_source) else 0
    carved = getattr(prepared, "carved", None)
    if carved and "test" in splits:
        splits["test"].held_out_of = (f"{carved['from']}: --eval_split_size {carved['eval_split_size']:g}, "
                                      f"seed {carved['seed']}")
    report = DataReport(max_length=training_args.max_length, packing=bool(training_args.packing),
                        packing_strategy=training_args.packing_strategy if training_args.packing else None,
                        truncation_mode=training_args.truncation_mode, cut_warning_share=CUT_WARNING_SHARE,
                        splits=splits, sources=sources)
    report.warnings = _warnings(report)
    return report


def write(report: DataReport, output_dir: str) -> Path:
    from sft_recipe.atomic import write_atomically

    path = Path(output_dir) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: tmp.write_text(report.to_json()))
    return path


def publish(report: DataReport, output_dir: str, is_main_process: bool) -> None:
    """Main process: the block in the log (its WARNING lines included) and data_report.json in output_dir."""
    if not is_main_process:
        return
    write(report, output_dir)
    print(report.render(output_dir), flush=True)


def confirm(report: DataReport, train_dataset, output_dir: str, is_main_process: bool) -> None:
    """Record what the trainer itself prepared for training, and say so if it differs from the prediction. The main
    process's to do (it holds the report)."""
    import pyarrow.compute as pc

    if not is_main_process:
        return

    tokens = loss_tokens = 0
    for batch in token_batches(train_dataset, ["labels"]):
        labels = np.asarray(pc.list_flatten(batch["labels"]), dtype=np.int64)
        tokens, loss_tokens = tokens + len(labels), loss_tokens + int((labels != IGNORE).sum())
    train = report.splits["train"]
    matches = (tokens, loss_tokens) == (train.tokens_trained, train.loss_tokens)
    report.trainer_check = {"tokens": tokens, "loss_tokens": loss_tokens, "matches_prediction": matches}
    if not matches:
        logger.warning(f"the trainer prepared {tokens} tokens ({loss_tokens} with loss); the data report predicted "
                       f"{train.tokens_trained} ({train.loss_tokens}). The report's numbers are approximate.")
    write(report, output_dir)


def _cut_position(length: int, training_args) -> int | None:
    """Where TRL cuts an example of this length: tokens before it are kept (keep_end: after it), or None."""
    limit = training_args.max_length
    if limit is None or length <= limit or (training_args.packing and
                                            training_args.packing_strategy in ("bfd_split", "wrapped")):
        return None
    return length - limit if training_args.truncation_mode == "keep_end" and not training_args.packing else limit


def preview(prepared, tokenizer, training_args, count: int, role: str = "train") -> str:
    """`count` examples as the model sees them: loss-carrying text between ⟦ ⟧, and where max_length cuts."""
    dataset = tokenized_splits(prepared, tokenizer, training_args)[role]
    tokenized = dataset.select(range(min(count, len(dataset))))
    keep_end = training_args.truncation_mode == "keep_end" and not training_args.packing
    blocks = []
    for n, row in enumerate(tokenized, start=1):
        ids, labels = row["input_ids"], row["labels"]
        cut = _cut_position(len(ids), training_args)
        seen = [cut is None or (k >= cut if keep_end else k < cut) for k in range(len(ids))]
        trained = [label != IGNORE and s for label, s in zip(labels, seen)]
        text, at = "", 0
        for k in range(1, len(ids) + 1):  # decode prefixes at each boundary: spacing stays the tokenizer's
            if k == len(ids) or trained[k] != trained[at] or k == cut:
                piece = tokenizer.decode(ids[:k])[len(tokenizer.decode(ids[:at])):]
                text += f"{LOSS_MARK[0]}{piece}{LOSS_MARK[1]}" if trained[at] else piece
                if k == cut:
                    side = "before" if keep_end else "after"
                    text += f"\n✂ -- cut at max_length {training_args.max_length}: the text {side} this is not " \
                            "trained --\n"
                at = k
        dropped = "; TRL drops this example: no loss-carrying token survives the cut" \
            if not any(trained) and not training_args.packing else ""
        blocks.append(f"=== {role} example {n} of {len(dataset)} ({prepared.formats[role]}): {len(ids)} tokens, "
                      f"{sum(trained)} trained with loss (between {LOSS_MARK[0]} and {LOSS_MARK[1]}){dropped} ===\n"
                      f"{text}")
    return "\n\n".join(blocks)
