"""SFTTrainer with the recipe's guarantees on every save and resume.

- Every save that writes adapter files goes through `adapter.save_final_adapter` (gathered, fixed, verified).
- FSDP1 checkpoints save and load the LoRA weights (peft 0.21's naming bug otherwise saves none and resumes from
  fresh LoRA weights with exit code 0).
- A resume that loads no trainable weights stops the run instead of silently training from scratch; a checkpoint file
  that cannot be read (or does not fit this model) stops it with exit code 2, the file named, not a traceback.
- Every checkpoint's marker records its files' sizes and checksums and what was trained (`resume_match.run_identity`).
- A full disk at a checkpoint, on any rank, ends every rank (`errors.DiskFull`, exit 74); older checkpoints are
  deleted for --save_total_limit only once the new one is marked complete.
- Checkpoints hold no pickles of ours: RNG, scheduler and one-process optimizer state are safetensors/JSON
  (`state_io`); FSDP shards stay in torch's DCP format, whose `.metadata` pickle is allow-list-checked before loading.
"""

from __future__ import annotations

import logging
import os

import torch
import transformers.trainer as transformers_trainer  # module attributes: keeps compat's patches of save/load_fsdp_model
from transformers import TrainerCallback
from trl import SFTTrainer

from sft_recipe import compat
from sft_recipe.artifacts.adapter import save_final_adapter
from sft_recipe.artifacts.checkpoints import checkpoint_layout, intact_checkpoints, mark_complete
from sft_recipe.artifacts.disk_full import guarded_save
from sft_recipe.artifacts.gather import adapter_state_keys, fsdp1_sharded_adapter_state
from sft_recipe.artifacts.generation import keeping_usage_section
from sft_recipe.artifacts.resume_match import run_identity, saved_run
from sft_recipe.artifacts.state_io import (
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    load_optimizer,
    load_rng_state,
    load_scheduler,
    rng_state_file,
    save_optimizer,
    save_rng_state,
    save_scheduler,
    unsafe_dcp_metadata,
)
from sft_recipe.compat import reshard_fsdp2_units
from sft_recipe.errors import ConfigError
from sft_recipe.measure import RssWatch, gpu_peak_gib, save_cost, unsharded_fsdp2_params, weight_mib
from sft_recipe.train.divergence import StepHealth
from sft_recipe.train.model import materialize_meta_buffers, materialize_meta_parameters
from sft_recipe.train.resume_settings import follow_changed_settings, group_settings, schedule_settings

logger = logging.getLogger(__name__)


class ResumeError(ConfigError):
    """A checkpoint that cannot be resumed from, found while loading it: train.py exits 2 with the message."""

    def __init__(self, message: str):
        super().__init__([message])


def unreadable(checkpoint, path, error: Exception) -> ResumeError:
    """A checkpoint file that failed to load: the file, the library's reason, and the intact checkpoints to use."""
    from pathlib import Path

    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    others = [p for p in intact_checkpoints(Path(checkpoint).parent) if p.name != Path(checkpoint).name]
    fix = (f"--resume_from_checkpoint {others[0]} (intact: {', '.join(p.name for p in others)})" if others else
           "a fresh --output_dir (or --overwrite_output_dir True: checkpoints move aside, nothing is deleted)")
    return ResumeError(f"--resume_from_checkpoint {checkpoint}: {path} cannot be loaded ({type(error).__name__}: "
                       f"{reason}). Fix: {fix}.")


def _trained_at_rate_zero(checkpoint) -> bool:
    """Every logged step of the checkpoint ran at learning rate 0 (a warmup's first step): its weights are the
    initial ones, which this launch's model (same seed) already holds, so an unchanged checksum is no failed load."""
    import json

    try:
        history = json.loads(open(os.path.join(checkpoint, "trainer_state.json")).read())["log_history"]
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: the checksum's verdict stands
        return False
    rates = [entry["learning_rate"] for entry in history if "learning_rate" in entry]
    return bool(rates) and not any(rates)


class ReshardAfterEvaluation(TrainerCallback):
    """Under FSDP2, put every unit back to its shard once an evaluation ends.

    Why: FSDP2 reshards a unit after its backward; a forward without backward (evaluation) leaves the units built
    with `reshard_after_forward=False` -- accelerate's root unit with the final norm and lm_head -- unsharded until
    the next backward. At 70B that is 0.5-4 GiB per GPU (bf16-fp32, 32k-128k vocabulary) held through the save that
    follows an end-of-epoch eval, and the unsharded unit's parameters are plain tensors instead of DTensors, so the
    run record's frozen-weight checksum summed full tensors instead of shards and reported "frozen weights CHANGED".
    `FSDPModule.reshard()` is torch's own call for this.
    """

    def __init__(self):
        self.unsharded_params_seen = 0  # most parameters an evaluation left unsharded (for the run record)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        unsharded = unsharded_fsdp2_params(model)  # counted before resharding: what the evaluation left gathered
        if reshard_fsdp2_units(model):  # 0 units: not FSDP2, nothing was counted that matters
            self.unsharded_params_seen = max(self.unsharded_params_seen, unsharded)


class BuffersFromRank0(TrainerCallback):
    """Buffers a rank built without values (materialize_meta_buffers) take rank 0's once the model is wrapped: the
    ranks agree on the names now (a collective, only where ranks exist), and rank 0 broadcasts each when training
    starts, after accelerate's preparation re-registered them on the device."""

    def __init__(self, names: list[str]):
        import torch.distributed as dist

        self.names = set(names)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sorted(self.names))
            self.names = set().union(*map(set, everyone))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist

        if not self.names or model is None or not dist.is_initialized():
            return
        buffers = {compat.strip_wrapper_segments(key): b for key, b in model.named_buffers()}  # FSDP1's segments
        for name in sorted(self.names):
            dist.broadcast(buffers[compat.strip_wrapper_segments(name)], src=0)


def upcast_trainable_half_params(model) -> int:
    """Train in fp32 what PEFT copied from a half-precision base: `modules_to_save` copies and trainable-token rows
    (LoRA/DoRA weights are fp32 already: PEFT's autocast_adapter_dtype). Returns how many were cast. Not for a
    quantized base: TRL casts QLoRA adapters to bf16 on purpose (the guide's FSDP1 QLoRA computes with them)."""
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False) or \
            getattr(getattr(model, "config", None), "quantization_config", None) is not None:
        return 0
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
            cast += 1
    return cast


class RecipeSFTTrainer(SFTTrainer):
    def __init__(self, *args, verify_adapter: bool = True, **kwargs):
        if not compat.installed():  # the library patches this trainer relies on (FSDP1 checkpoint names, ...)
            raise RuntimeError("call sft_recipe.compat.install(launch) before building RecipeSFTTrainer")
        super().__init__(*args, **kwargs)
        if not self.is_deepspeed_enabled:  # DeepSpeed's bf16 engine keeps fp32 master weights itself
            upcast_trainable_half_params(self.model)
        self.verify_adapter = verify_adapter
        # Chosen now, before FSDP wraps the model: which tensors every adapter save gathers (gather.py).
        self.adapter_keys = adapter_state_keys(self.model)
        # Weights this rank read while loading (0 where cpu_ram_efficient_loading built it on meta: they arrive from
        # rank 0 when FSDP wraps the model), measured before the placeholders below exist.
        self.weight_mib_after_load = weight_mib(self.model)
        # GPU memory from process start until now (load, LoRA layers), before FSDP wraps anything; None on CPU.
        self.gpu_peak_gib_after_load = gpu_peak_gib()
        # What every checkpoint's marker records of this run (base, tokenizer size, LoRA shape, read before wrapping;
        # the schedule's flags, said old -> new when a resume changes them).
        self.run_identity = {**run_identity(self.model, self.processing_class),
                             "schedule": schedule_settings(self.args)} if self.args.should_save else None
        materialize_meta_parameters(self.model)
        self.add_callback(BuffersFromRank0(materialize_meta_buffers(self.model)))
        self.checkpoint_save_costs: list[dict] = []  # per checkpoint: seconds, added RSS per rank (run record)
        self.reshard_after_evaluation = ReshardAfterEvaluation()
        self.add_callback(self.reshard_after_evaluation)
        # Every micro-batch loss and step gradient norm, watched for non-finite values (divergence.py; read at the
        # step end by preemption.StopAtStepEnd). fp16's GradScaler skips steps with non-finite gradients itself.
        self.step_health = StepHealth(scaler_in_use=getattr(self.accelerator, "scaler", None) is not None)
        # Whether an optimizer step of this launch ran at a rate above 0: a warmup's first step runs at 0, so a
        # checkpoint after it holds lora_B still zero, which the adapter check must not call "never updated".
        self.applied_a_nonzero_rate = False

    def training_step(self, *args, **kwargs):
        if not self.applied_a_nonzero_rate and self.lr_scheduler is not None:
            self.applied_a_nonzero_rate = any(rate > 0 for rate in self.lr_scheduler.get_last_lr())
        loss = super().training_step(*args, **kwargs)
        self.step_health.observe_loss(loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.step_health.observe_grad_norm(grad_norm)
        return grad_norm

    def _writes_adapter_files(self) -> bool:
        from peft import PeftModel

        if not isinstance(self.accelerator.unwrap_model(self.model), PeftModel):
            return False
        if not self.is_fsdp_enabled:
            return True
        return "FULL_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Adapter saves (single process, or FSDP FULL_STATE_DICT) are checked like the final adapter."""
        if not self._writes_adapter_files():
            super().save_model(output_dir, _internal_call)
            return
        save_final_adapter(self, output_dir or self.args.output_dir, verify=self.verify_adapter,
                           trust_remote_code=self.args.trust_remote_code)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, *args, **kwargs):
        """TRL's card, written over output_dir's README.md before a push uploads the folder (and at every
        checkpoint), keeps the recipe's loading section (artifacts/generation.py)."""
        with keeping_usage_section(self.args.output_dir, self.is_world_process_zero()):
            super().create_model_card(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        """Mark the checkpoint complete once every rank has written it (resume skips unmarked ones), and only then
        delete older ones (--save_total_limit): a save that fails never costs an intact checkpoint. A full disk on
        any rank ends every rank with DiskFull (train.py exits 74), saying what was kept (artifacts/disk_full.py)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit = self.args.save_total_limit

        def save():
            self.args.save_total_limit = None  # transformers would rotate before this checkpoint is marked complete
            try:
                super(RecipeSFTTrainer, self)._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit

        with RssWatch() as watch:
            guarded_save(self.accelerator, folder, save)  # ends as a barrier: every rank has written its part
        self.checkpoint_save_costs.append(save_cost(self.accelerator, watch))
        guarded_save(self.accelerator, folder, lambda: self._mark_and_rotate(folder, run_dir, limit), main_only=True)

    def _mark_and_rotate(self, folder: str, run_dir: str, limit: int | None) -> None:
        from sft_recipe.artifacts.generation import ensure_generation_config

        # Before the marker records the files: FSDP SHARDED checkpoints get generation_config.json here (no adapter
        # save wrote one); where save_final_adapter wrote it, it is left as it is.
        ensure_generation_config(folder, self)
        args = self.args
        mark_complete(folder, self.state.global_step, world_size=args.world_size, global_batch_size=(
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size),
            run=self.run_identity)
        if args.should_save:
            transformers_trainer.rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                                                    best_model_checkpoint=self.state.best_model_checkpoint,
                                                    use_mtime=True)

    def _save_rng_state(self, output_dir: str) -> None:
        save_rng_state(rng_state_file(output_dir, self.args.process_index, self.args.world_size))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        saved_world_size = checkpoint_layout(checkpoint).get("world_size")
        if saved_world_size and saved_world_size != self.args.world_size:
            if self.accelerator.is_main_process:
                logger.warning(f"resuming on {self.args.world_size} ranks from a checkpoint of {saved_world_size}: "
                               "weights and optimizer state reshard, data order and learning-rate schedule continue; "
                               "random streams (dropout) start afresh on every rank.")
            return
        path = rng_state_file(checkpoint, self.args.process_index, self.args.world_size)
        if not path.is_file():  # e.g. resumed on a different number of ranks: weights reshard, RNG streams cannot
            logger.warning(f"{path} not found: random state starts afresh (data order is still restored).")
            return
        try:
            load_rng_state(path)
        except Exception as e:  # damaged after its marker was written, or not one of ours
            raise unreadable(checkpoint, path, e) from None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.is_deepspeed_enabled:  # DeepSpeed writes its own checkpoint format
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.is_fsdp_enabled:  # sharded model + optimizer as DCP folders, through transformers' own functions
            plugin = self.accelerator.state.fsdp_plugin
            if not self._save_fsdp1_adapter_shards(output_dir):
                transformers_trainer.save_fsdp_model(plugin, self.accelerator, self.model, output_dir,
                                                     **transformers_trainer.get_fsdp_ckpt_kwargs())
            transformers_trainer.save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir)
        elif self.args.should_save:
            save_optimizer(self.optimizer, os.path.join(output_dir, OPTIMIZER_FILE))
        if self.args.should_save:
            save_scheduler(self.lr_scheduler, os.path.join(output_dir, SCHEDULER_FILE))

    def _save_fsdp1_adapter_shards(self, output_dir: str) -> bool:
        """FSDP1 SHARDED checkpoints: write the adapter's shards without touching the frozen base (see
        gather.fsdp1_sharded_adapter_state); False where accelerate's own save must do it."""
        plugin = self.accelerator.state.fsdp_plugin
        if plugin.fsdp_version != 1 or "SHARDED_STATE_DICT" not in str(plugin.state_dict_type):
            return False
        state = fsdp1_sharded_adapter_state(self.model, self.adapter_keys)
        if state is None:
            return False
        import torch.distributed.checkpoint as dist_cp
        from accelerate.utils.constants import FSDP_MODEL_NAME
        from peft import get_peft_model_state_dict

        peft_model = self.accelerator.unwrap_model(self.model)
        with compat.module_names_without_fsdp_segments(peft_model):  # the keys accelerate's loader will ask for
            state = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=peft_model.active_adapter)
        dist_cp.save(state_dict={"model": state},
                     storage_writer=dist_cp.FileSystemWriter(os.path.join(output_dir, f"{FSDP_MODEL_NAME}_0")))
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from sft_recipe.measure import trainable_checksum

        unsafe = unsafe_dcp_metadata(resume_from_checkpoint)
        if unsafe:
            raise ResumeError("refusing to load a checkpoint whose index holds more than checkpoint metadata "
                              "(torch would unpickle it): " + "; ".join(unsafe))
        target = model if model is not None else self.model
        before = trainable_checksum(self.accelerator, target)
        try:
            result = super()._load_from_checkpoint(resume_from_checkpoint, model)
        except Exception as e:  # "size mismatch for ..." (another LoRA shape), a damaged adapter file
            raise unreadable(resume_from_checkpoint, "its model/adapter weights", e) from None
        if trainable_checksum(self.accelerator, target) == before and not _trained_at_rate_zero(resume_from_checkpoint):
            raise ResumeError(
                f"resuming from {resume_from_checkpoint} loaded no trainable weights: training would silently "
                "restart from fresh LoRA weights. The checkpoint may come from another model/adapter config, or "
                "was written without its adapter weights.")
        return result

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        # What this launch's flags built, kept for a resume (resume_settings): under DeepSpeed the engine restores
        # the checkpoint's optimizer before _load_optimizer_and_scheduler runs, so this is the last sight of it.
        self.built_param_groups = group_settings(self.optimizer, holding_only=self.is_deepspeed_enabled)
        return optimizer

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # What this launch's flags built, before the checkpoint's hyperparameters replace it (resume_settings);
        # None under DeepSpeed with an optimizer of its own config (the Trainer built none).
        if self.is_deepspeed_enabled:
            built = getattr(self, "built_param_groups", None)
        else:
            built = group_settings(self.optimizer)
        if self.is_deepspeed_enabled:
            super()._load_optimizer_and_scheduler(checkpoint)
        else:
            self._load_optimizer_and_scheduler_state(checkpoint)
        followed, not_followed = follow_changed_settings(self.optimizer, self.lr_scheduler, self.args, built,
                                                         (saved_run(checkpoint) or {}).get("schedule"))
        if self.accelerator.is_main_process and followed:
            logger.info(f"resume: this launch's settings replace the checkpoint's: {', '.join(followed)}")
        if self.accelerator.is_main_process and not_followed:
            logger.warning(f"resume: the checkpoint's {', '.join(not_followed)} stay as saved: this launch's "
                           "optimizer groups could not be matched to the checkpoint's one to one (or, under a "
                           "DeepSpeed config with an optimizer of its own, it built none); the learning rate follows "
                           "the flag.")

    def _load_optimizer_and_scheduler_state(self, checkpoint):
        if self.is_fsdp_enabled:
            plugin = self.accelerator.state.fsdp_plugin
            if plugin.fsdp_version == 1:
                compat.init_optimizer_state_before_fsdp1_load(self.optimizer)
            transformers_trainer.load_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, checkpoint,
                                                     **transformers_trainer.get_fsdp_ckpt_kwargs())
        else:
            path = os.path.join(checkpoint, OPTIMIZER_FILE)
            if not os.path.isfile(path):
                raise ResumeError(f"{checkpoint} has no {OPTIMIZER_FILE}: it was not written by this recipe "
                                  "(or by a version before it stopped writing pickles). Start fresh instead.")
            try:
                load_optimizer(self.optimizer, path)
            except Exception as e:  # damaged file, or state of another shape
                raise unreadable(checkpoint, path, e) from None
        scheduler_path = os.path.join(checkpoint, SCHEDULER_FILE)
        if not os.path.isfile(scheduler_path):
            raise ResumeError(f"{checkpoint} has no {SCHEDULER_FILE}: the learning-rate schedule cannot continue.")
        try:
            load_scheduler(self.lr_scheduler, scheduler_path)
        except Exception as e:
            raise unreadable(checkpoint, scheduler_path, e) from None
        if not any(self.optimizer.state.values()):
            raise ResumeError(f"resuming from {checkpoint} restored no optimizer state: training would continue "
                              "with fresh Adam moments and diverge from the interrupted run.")
