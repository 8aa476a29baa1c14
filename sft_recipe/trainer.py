"""SFTTrainer with the recipe's guarantees on every save and resume.

- Every save that writes adapter files goes through `adapter.save_final_adapter` (gathered, fixed, verified).
- FSDP1 checkpoints save and load the LoRA weights (peft 0.21's naming bug otherwise saves none and resumes from
  fresh LoRA weights with exit code 0).
- A resume that loads no trainable weights stops the run instead of silently training from scratch.
- Checkpoints hold no pickles of ours: RNG, scheduler and one-process optimizer state are safetensors/JSON
  (`state_io`); FSDP shards stay in torch's DCP format, whose `.metadata` pickle is allow-list-checked before loading.
"""

from __future__ import annotations

import logging
import os

import transformers.trainer as transformers_trainer  # module attributes: keeps compat's patches of save/load_fsdp_model
from trl import SFTTrainer

from . import compat
from .adapter import save_final_adapter
from .checkpoints import mark_complete
from .gather import adapter_state_keys
from .state_io import (OPTIMIZER_FILE, SCHEDULER_FILE, load_optimizer, load_rng_state, load_scheduler,
                       rng_state_file, save_optimizer, save_rng_state, save_scheduler, unsafe_dcp_metadata)


logger = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    pass


class RecipeSFTTrainer(SFTTrainer):
    def __init__(self, *args, verify_adapter: bool = True, **kwargs):
        compat.fsdp1_checkpoint_model_io_with_clean_names()
        compat.trainable_tokens_lm_head_bias()
        super().__init__(*args, **kwargs)
        self.verify_adapter = verify_adapter
        # Chosen now, before FSDP wraps the model: which tensors every adapter save gathers (gather.py).
        self.adapter_keys = adapter_state_keys(self.model)

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

    def _save_checkpoint(self, model, trial):
        """Mark the checkpoint complete once every rank has written it (resume skips unmarked ones)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            mark_complete(folder, self.state.global_step)

    def _save_rng_state(self, output_dir: str) -> None:
        save_rng_state(rng_state_file(output_dir, self.args.process_index, self.args.world_size))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = rng_state_file(checkpoint, self.args.process_index, self.args.world_size)
        if not path.is_file():  # e.g. resumed on a different number of ranks: weights reshard, RNG streams cannot
            logger.warning(f"{path} not found: random state starts afresh (data order is still restored).")
            return
        load_rng_state(path)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.is_deepspeed_enabled:  # DeepSpeed writes its own checkpoint format
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.is_fsdp_enabled:  # sharded model + optimizer as DCP folders, through transformers' own functions
            plugin = self.accelerator.state.fsdp_plugin
            transformers_trainer.save_fsdp_model(plugin, self.accelerator, self.model, output_dir,
                                                 **transformers_trainer.get_fsdp_ckpt_kwargs())
            transformers_trainer.save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir)
        elif self.args.should_save:
            save_optimizer(self.optimizer, os.path.join(output_dir, OPTIMIZER_FILE))
        if self.args.should_save:
            save_scheduler(self.lr_scheduler, os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from .report import trainable_checksum

        unsafe = unsafe_dcp_metadata(resume_from_checkpoint)
        if unsafe:
            raise ResumeError("refusing to load a checkpoint whose index holds more than checkpoint metadata "
                              "(torch would unpickle it): " + "; ".join(unsafe))
        target = model if model is not None else self.model
        before = trainable_checksum(self.accelerator, target)
        result = super()._load_from_checkpoint(resume_from_checkpoint, model)
        if trainable_checksum(self.accelerator, target) == before:
            raise ResumeError(
                f"resuming from {resume_from_checkpoint} loaded no trainable weights: training would silently "
                "restart from fresh LoRA weights. The checkpoint may come from another model/adapter config, or "
                "was written without its adapter weights.")
        return result

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or self.is_deepspeed_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)
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
            load_optimizer(self.optimizer, path)
        scheduler_path = os.path.join(checkpoint, SCHEDULER_FILE)
        if not os.path.isfile(scheduler_path):
            raise ResumeError(f"{checkpoint} has no {SCHEDULER_FILE}: the learning-rate schedule cannot continue.")
        load_scheduler(self.lr_scheduler, scheduler_path)
        if not any(self.optimizer.state.values()):
            raise ResumeError(f"resuming from {checkpoint} restored no optimizer state: training would continue "
                              "with fresh Adam moments and diverge from the interrupted run.")
