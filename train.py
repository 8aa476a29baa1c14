"""Supervised fine-tuning with LoRA / QLoRA, on one device or sharded with FSDP.

    accelerate launch --config_file configs/fsdp_config.yaml train.py --model_name_or_path ... [flags]

The story, top to bottom: arguments -> data -> tokenizer/model/LoRA -> trainer -> train -> save -> verify.
Run `python train.py --help` for every flag; `--config recipe.yaml` supplies defaults the command line overrides.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from sft_recipe.startup import freeze_imports, imports_frozen, prepare_imports

if __name__ == "__main__":  # before the libraries load: no cyclic collection while they import, and what the flags
    prepare_imports(sys.argv[1:])  # say the run cannot use (bitsandbytes, wandb, DeepSpeed) kept out

import torch
import torch.distributed as dist
import transformers  # lazy: its submodules load after sft_recipe set the library log levels (sft_recipe/__init__)

from sft_recipe import compat
from sft_recipe.artifacts.adapter import ADAPTER_CHECK_EXIT_CODE, AdapterCheckError, save_final_adapter
from sft_recipe.artifacts.checkpoints import (
    intact_checkpoints,
    move_damaged_aside,
    move_previous_run_aside,
    resolve_resume,
)
from sft_recipe.artifacts.disk_full import DISK_FULL_EXIT_CODE, SaveFailedElsewhere, unguarded_disk_full
from sft_recipe.artifacts.run_hold import release_run_hold, take_run_hold
from sft_recipe.config.args import parse_args
from sft_recipe.config.launch_env import LaunchEnv, read_launch_env
from sft_recipe.data import report as data_report
from sft_recipe.data.prepare import dataset_flag_notes
from sft_recipe.data.prepared_copy import confirm_report, measure_report, prepare_data
from sft_recipe.errors import ConfigError, DiskFull, is_disk_full
from sft_recipe.logs import quiet_other_ranks
from sft_recipe.model.architecture import lora_targets
from sft_recipe.plan import plan_memory
from sft_recipe.preflight.file_checks import check_tokenizer
from sft_recipe.preflight.validate import validate
from sft_recipe.train.divergence import DIVERGED_EXIT_CODE, Diverged
from sft_recipe.train.gptq import checkpoint_quant_method  # a GPTQ base is recorded as quantization "gptq"
from sft_recipe.train.lost_rank import LostRank, lost_a_rank, lost_rank_message, lost_rank_said
from sft_recipe.train.model import added_token_ids, load_model, load_tokenizer, lora_config, untrained_token_note
from sft_recipe.train.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_FILE, Preempted, StopAtStepEnd
from sft_recipe.train.quantized_identity import check_quantized_base_identical
from sft_recipe.train.record import RunRecord
from sft_recipe.train.start_adapter import load_start_adapter
from sft_recipe.train.trackers import PlanToTrackers, plan_for_trackers
from sft_recipe.train.trainer import RecipeSFTTrainer

if __name__ == "__main__":  # what the imports created is never walked again; collecting resumes for the rest
    freeze_imports()

logger = logging.getLogger("train")
REFUSAL_GRACE_S = 10.0  # how long a rank that refused waits for the main process to say it (train.say_refusal)


def main(argv: list[str] | None, launch: LaunchEnv) -> None:
    # 1. Arguments: parse (derived settings resolved there) for this launch (the launcher's environment, read once),
    #    install the library workarounds (FSDP made real on CPU among them), check everything before any weight is
    #    loaded. Nothing below changes them.
    model_args, data_args, recipe_args, training_args = parse_args(argv, launch)
    compat.install(launch)
    quiet_other_ranks(launch)  # one set of progress bars and warnings, not one per rank
    validate(model_args, data_args, recipe_args, training_args, launch)
    if recipe_args.plan_memory_gib:  # will it fit? answered from the model config alone, then exit
        print_memory_plan_and_exit(model_args, data_args, recipe_args, training_args, launch)
    take_run_hold(training_args.output_dir, launch)  # one run per output_dir: before anything in it is moved
    resume_from = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)[0]
    transformers.set_seed(training_args.seed)

    # 2. Tokenizer (it carries the chat template the data needs) and data: format recognised, every row checked,
    #    converted for TRL, measured as TRL will tokenize it -- all before any weight is loaded.
    tokenizer = load_tokenizer(model_args, training_args.trust_remote_code)
    check_tokenizer(model_args, tokenizer, resume_from, training_args.trust_remote_code)  # fits model, checkpoint
    data = prepare_data(data_args, training_args, tokenizer, launch)  # one process per machine; kept for the next
    for note in data.notes:  # the format each split was recognised as, and what TRL is given
        logger.info(note)
    for note in dataset_flag_notes(data_args, data.formats["train"] != "text"):
        logger.warning(note)
    # The report is the main process's to measure, print and write (the others would only repeat it).
    report = measure_report(data, tokenizer, training_args) if launch.is_main_process else None
    if data_args.preview_examples:  # show what is trained (loss-carrying tokens marked) and the report, then exit
        print_preview_and_exit(data, report, tokenizer, training_args, data_args.preview_examples, launch)
    # Every refusal that comes before the weights is behind us (exit 2 changes nothing in output_dir): only now are
    # damaged checkpoints and, with --overwrite_output_dir, the previous run moved aside (never deleted).
    move_damaged_aside(training_args.output_dir, resume_from, launch.is_main_process)  # not written over by this run
    if recipe_args.overwrite_output_dir and not resume_from and launch.is_main_process:
        move_previous_run_aside(training_args.output_dir)
    # One block in the log + output_dir/data_report.json.
    data_report.publish(report, training_args.output_dir, launch.is_main_process)
    datasets = data.tokenized  # TRL finds them tokenized: it only cuts or packs them

    # 3. Model, sized to the tokenizer; SFTTrainer wraps it with the LoRA config and FSDP.
    model = load_model(model_args, training_args, tokenizer, launch)
    if (note := check_quantized_base_identical(model, launch)) and launch.is_main_process:
        logger.info(note)  # every rank quantized the same bytes (a collective; a rank that differs stops them all)
    new_token_ids = added_token_ids(model_args, tokenizer, training_args.trust_remote_code)
    if note := untrained_token_note(model_args, new_token_ids):
        logger.warning(note)
    if model_args.use_peft_lora and (note := lora_targets(model_args, training_args.trust_remote_code).note()):
        logger.warning(note)  # what all-linear leaves untrained on this family, and why

    # 4. Trainer: TRL's, with every adapter save (checkpoints too) gathered, fixed and verified.
    trainer = RecipeSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets["train"],
        eval_dataset=datasets.get("test"),
        processing_class=tokenizer,
        peft_config=lora_config(model_args, new_token_ids, training_args.trust_remote_code),
        verify_adapter=recipe_args.verify_adapter,
    )
    if model_args.adapter_name_or_path and not resume_from:  # its weights, before any engine wraps the model
        load_start_adapter(trainer.model, model_args.adapter_name_or_path)
    confirm_report(report, data, trainer.train_dataset, training_args, launch.is_main_process)  # the trainer's counts
    record = RunRecord.attach(trainer, recipe_args.peak_tflops_per_device)  # how it ran, tokens/s, memory, losses
    record.set("data", **data.preparation)  # which ranks prepared the data, which read their copy
    if plan := plan_for_trackers(model_args, data_args, training_args, launch):  # W&B, MLflow: beside the measured
        trainer.add_callback(PlanToTrackers(plan, training_args.report_to))
    # Every rank stops at the same step end on SIGTERM/SIGUSR1/Ctrl-C (checkpointed) or a non-finite loss or
    # gradient norm on any rank (nothing saved).
    stopper = StopAtStepEnd(trainer, trainer.step_health if recipe_args.stop_on_nonfinite else None,
                            launch.launcher_shutdown_timeout_s)
    trainer.add_callback(stopper)
    if model_args.use_peft_lora and trainer.accelerator.is_main_process:
        trainer.model.print_trainable_parameters()

    # 5. Train. SIGTERM/SIGUSR1/Ctrl-C on any rank: every rank checkpoints at the same step, then we exit to be
    #    resumed. Divergence: every rank stops at that step; the record and loss curve show where, nothing is saved.
    # A collective that fails because another rank is gone (here, in the save and in the push) is said in one line
    # naming the newest intact checkpoint (run()); before training, in one saying nothing was written.
    with lost_rank_said(launch.rank, training_args.output_dir):
        trainer.train(resume_from_checkpoint=resume_from)
    try:
        stopper.raise_if_stopped(training_args.output_dir, intact_checkpoints)
    except Diverged:
        record.write(training_args.output_dir, final_save=None, plot=recipe_args.plot_loss_curve,
                     run=run_facts(model_args, data_args, recipe_args, training_args))
        raise

    # 6. Save the FULL_STATE_DICT adapter (all ranks take part) and verify it before it replaces anything.
    with lost_rank_said(launch.rank, training_args.output_dir):
        final_save = save_final_adapter(trainer, training_args.output_dir, verify=recipe_args.verify_adapter,
                                        trust_remote_code=training_args.trust_remote_code)
    # quantization: merge_adapter.py reads it to merge a QLoRA/GPTQ adapter into the bf16 base, never the 4-bit one.
    record.write(training_args.output_dir, final_save=final_save,  # run_record.json + loss_curve.png
                 run=run_facts(model_args, data_args, recipe_args, training_args), plot=recipe_args.plot_loss_curve)
    if trainer.accelerator.is_main_process:  # this run finished: an earlier preemption note no longer applies
        Path(training_args.output_dir, PREEMPTED_FILE).unlink(missing_ok=True)

    # 7. Publish (every rank calls push_to_hub: it saves collectively, then the main process uploads).
    if training_args.push_to_hub:
        with lost_rank_said(launch.rank, training_args.output_dir):
            trainer.push_to_hub()
    elif recipe_args.defer_push_to_hub and trainer.accelerator.is_main_process:
        repo = training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir))
        print(f"Push deferred. Upload later with: {deferred_upload_command(repo, training_args, final_save)}",
              flush=True)


def deferred_upload_command(repo: str, training_args, final_save: dict) -> str:
    """`hf upload` of the checked adapter folder's files alone (the run record's saves.final.files): output_dir also
    holds checkpoints, a moved-aside previous run, logs and the run record, which `hf upload` would send too."""
    files = "".join(f" --include {shlex.quote(name)}" for name in final_save.get("files") or [])
    private = " --private" if training_args.hub_private_repo is not False else ""
    return f"hf upload {repo} {shlex.quote(training_args.output_dir)}{files}{private}"


def run_facts(model_args, data_args, recipe_args, training_args) -> dict:
    """The run record's `run` section: what was trained."""
    return {"model_name_or_path": model_args.model_name_or_path, "dataset_name": data_args.dataset_name,
            "quantization": "4bit" if model_args.use_4bit_quantization else
            "8bit" if model_args.use_8bit_quantization else
            checkpoint_quant_method(model_args.model_name_or_path, training_args.trust_remote_code),
            "config": {"model": asdict(model_args), "data": asdict(data_args), "recipe": asdict(recipe_args),
                       "training": training_args.to_dict()},
            "skipped_imports": compat.skipped_imports(),  # installed, and kept out: the run uses none of it
            "imports_frozen": imports_frozen()}  # the libraries' objects never walked by the collector (startup)


def print_preview_and_exit(data, report, tokenizer, training_args, count: int, launch: LaunchEnv) -> None:
    if launch.is_main_process:
        print(data_report.preview(data, tokenizer, training_args, count), report.render(), sep="\n\n", flush=True)
    raise SystemExit(0)


def print_memory_plan_and_exit(model_args, data_args, recipe_args, training_args, launch: LaunchEnv) -> None:
    device = "cuda" if torch.cuda.is_available() and not training_args.use_cpu else "cpu"
    plan = plan_memory(model_args, data_args, training_args, accelerate_config=launch.accelerate_config(),
                       gpu_memory_gib=recipe_args.plan_memory_gib, device=device)
    if launch.is_main_process:
        print(plan.render(), flush=True)
    raise SystemExit(0 if plan.fits else 3)


def run(launch: LaunchEnv) -> int:
    """Entry point, exit codes (docs/reliability.md): 0 done; 2 a user mistake, listed without a traceback; 4 diverged;
    5 a saved adapter failed its check (kept in _adapter-FAILED-CHECK/, nothing replaced); 74 a full disk at a save
    (the newest intact checkpoint kept); 75 preempted and 130 Ctrl-C, both checkpointed."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        main(None, launch)
    except ConfigError as e:
        say_refusal(e, launch)
        return 2
    except Preempted as e:  # a checkpoint was written: 75 (SIGTERM/SIGUSR1), 130 (Ctrl-C)
        if launch.is_main_process:
            print(f"{'interrupted' if e.exit_code == 130 else 'preempted'}: {e}", file=sys.stderr, flush=True)
        wait_for_every_rank()
        return e.exit_code
    except Diverged as e:  # every rank stopped at the step; nothing of the broken state was saved
        if launch.is_main_process:
            print(f"diverged: {e}", file=sys.stderr, flush=True)
        wait_for_every_rank()
        return DIVERGED_EXIT_CODE
    except (DiskFull, OSError) as e:  # a save ran out of space; OSError: a write outside the saves (run record)
        if not is_disk_full(e):
            raise
        if launch.is_main_process or not isinstance(e, DiskFull):
            print(f"disk full: {e if isinstance(e, DiskFull) else unguarded_disk_full(e)}", file=sys.stderr, flush=True)
        return DISK_FULL_EXIT_CODE
    except AdapterCheckError as e:  # the main process checked what it wrote; the other ranks learn it below
        print(f"error: {e}\nNothing was replaced: a previous adapter in --output_dir stays as it was. Please report "
              "the model and flags (docs/models.md lists what each family allows).", file=sys.stderr, flush=True)
        return ADAPTER_CHECK_EXIT_CODE
    except SaveFailedElsewhere as e:  # another rank's save failed: its own message says how (5 for a failed check)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except LostRank as e:  # another rank died (SIGKILL, a crash) mid-collective: one line per survivor, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # ...or before training (the data's hand-over, the 4-bit state, the trainer's set-up)
        if not lost_a_rank(e):
            raise
        print(f"error: {lost_rank_message(launch.rank, e, None, before_training=True)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before training began, or a second one during it: abort, no traceback
        if launch.is_main_process:
            print("aborted by Ctrl-C: nothing more was saved (a checkpoint being written is left unmarked, and "
                  "--resume_from_checkpoint latest skips it).", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    finally:
        release_run_hold()  # however train.py ends (a crash leaves the hold to be found stale)
        close_process_group()
    return 0


def say_refusal(e: ConfigError, launch: LaunchEnv, grace_s: float = REFUSAL_GRACE_S) -> None:
    """The main process lists a refusal. Every rank runs the same checks, so the others refused too: they wait for it,
    since torchrun SIGTERMs every rank as soon as one exits non-zero, and one that left first would cut the main process
    off before its message (seen on a loaded 2-core CI machine). A rank still alive after the grace refused alone (a
    problem only it sees, the main process waiting in a collective): it says its own. Either way it exits 2, as the
    main process does: torchrun's SIGTERM only ends the wait."""
    if not launch.is_main_process:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))  # nothing to save or release: the run never began
        try:
            time.sleep(grace_s)
        except KeyboardInterrupt:  # Ctrl-C reaches every rank: it ends the wait as SIGTERM does, with no traceback
            pass
    print(f"error{'' if launch.is_main_process else f' (rank {launch.rank})'}: {e}", file=sys.stderr, flush=True)


def wait_for_every_rank() -> None:
    """Ranks that stopped together (preempted, diverged) also exit together: torchrun SIGTERMs the others as soon as
    one rank exits non-zero, which would cut off the main process's message and files."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def close_process_group() -> None:
    """Tear the process group down before exit: left to interpreter shutdown, gloo's threads can abort the process
    ("terminate called without an active exception", SIGABRT) after a successful run, turning it into a failure."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def read_launch_env_or_exit() -> LaunchEnv:
    try:
        return read_launch_env()
    except ConfigError as e:  # a launcher variable accelerate would not read either
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    launch_env = read_launch_env_or_exit()
    compat.exit_skipping_teardown(run(launch_env), launch_env.world_size)
