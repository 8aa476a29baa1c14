#!/usr/bin/env bash
# LoRA + FSDP across several machines under Slurm: one `accelerate launch` per node, GPUS_PER_NODE ranks on each.
#   sbatch --nodes=2 run_peft_slurm.sh [extra train.py flags, which override the ones below]
# Submit from the repository with its Python environment active (sbatch exports it to every node). OUTPUT_DIR and
# the Hugging Face cache (HF_HOME) must be on a filesystem every node sees: all ranks write checkpoint shards there.
# Overridable without editing this file (export them before sbatch):
#   MODEL=meta-llama/Llama-2-70b-hf  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=llama-sft-lora-fsdp-multinode
#   ACCELERATE_CONFIG=configs/multi_node/fsdp_config.yaml (or multi_node/fsdp2_config.yaml, fsdp_config_qlora.yaml;
#     any config works, DeepSpeed's too: every multi-machine setting is passed on the command line below)
#   GPUS_PER_NODE=(Slurm's count, else 8)  MAIN_PROCESS_PORT=29500  MAX_REQUEUES=10  AUTO_RESUME=1
#   RECIPE_SCRIPT=(the launcher whose flags fit ACCELERATE_CONFIG: run_peft_qlora_fsdp.sh for a QLoRA config, the
#     DeepSpeed scripts for DeepSpeed configs, else run_peft_fsdp.sh)
# Time limit and preemption: Slurm sends SIGUSR1 to every process of the job step 300 s before the end; each rank
# checkpoints at the same step and the run exits 75. This script then requeues the job (`scontrol requeue`), and the
# requeued job resumes from the newest complete checkpoint in OUTPUT_DIR (AUTO_RESUME=0 turns that off).
#SBATCH --job-name=peft-sft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
# sbatch runs a spooled copy of this file, so the script's own folder is not the repository: the submit folder is.
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"

if [[ -z "${SLURM_JOB_ID:-}" || -z "${SLURM_NNODES:-}" || -z "${SLURM_JOB_NODELIST:-}" ]]; then
  echo "error: run_peft_slurm.sh is a Slurm batch script, but SLURM_JOB_ID/SLURM_NNODES/SLURM_JOB_NODELIST are not" \
       "set. Fix: submit it with \`sbatch --nodes=2 run_peft_slurm.sh ...\`; on one machine use run_peft_fsdp.sh." >&2
  exit 2
fi

MODEL=${MODEL:-meta-llama/Llama-2-70b-hf}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-llama-sft-lora-fsdp-multinode}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/multi_node/fsdp_config.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500}
MAX_REQUEUES=${MAX_REQUEUES:-10}
AUTO_RESUME=${AUTO_RESUME:-1}
NNODES=$SLURM_NNODES

# Machine 0 is the first host of the allocation: srun gives it task 0, and the static rendezvous below puts global
# rank 0 there, listening on MAIN_PROCESS_PORT.
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#HOSTS[@]} != NNODES )); then
  echo "error: scontrol lists ${#HOSTS[@]} hosts for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST but SLURM_NNODES is" \
       "$NNODES. Fix: run this script only as a whole-allocation batch job (sbatch --nodes=N)." >&2
  exit 2
fi
MAIN_PROCESS_IP=${HOSTS[0]}

# A requeued (or resubmitted) job continues from the newest complete checkpoint instead of starting over.
RESUME=()
if [[ "$AUTO_RESUME" == 1 ]] && compgen -G "$OUTPUT_DIR/checkpoint-*/checkpoint_complete.json" > /dev/null; then
  RESUME=(--resume_from_checkpoint latest)
fi

# train.py writes this note when it stops for a signal; only a note written by THIS run means "requeue me" (a note
# left by an earlier preemption must not requeue a run that failed for another reason): note_fingerprint.
source scripts/lib/launch_common.sh
PREEMPTED_NOTE="$OUTPUT_DIR/preempted.json"
note_before=$(note_fingerprint)
# The launcher whose flags fit the config: a QLoRA config trains with the QLoRA flags (4-bit), a DeepSpeed config
# with its script. RECIPE_SCRIPT=run_peft_....sh picks one by hand.
RECIPE_SCRIPT=${RECIPE_SCRIPT:-$(recipe_script_for "$ACCELERATE_CONFIG")}
if [[ ! -f "$RECIPE_SCRIPT" ]]; then
  echo "error: RECIPE_SCRIPT=$RECIPE_SCRIPT: no such launcher here. Fix: one of $(ls run_peft_*.sh | grep -v slurm | tr '\n' ' ')" >&2
  exit 2
fi

# Runs on every node. SLURM_PROCID is read there (single quotes): expanded here it would be 0 on every node.
# The launcher (torchrun's agent) ignores SIGUSR1: Slurm signals every process of the step, and by default SIGUSR1
# kills the agent at once, which ends the step and kills the ranks in the middle of writing their checkpoint. The
# ranks replace the inherited "ignore" with train.py's handler when training starts.
# The launcher flags that make one node one machine of NNODES; the recipe's launcher (RECIPE_SCRIPT) adds them to
# its `accelerate launch`. SLURM_PROCID is read on each node (single quotes below): expanded here
# it would be 0 on every node.
# --rdzv_backend static (not c10d): Slurm already numbers the nodes and starts them together, and static keeps
# --machine_rank, so global rank 0 is on MAIN_PROCESS_IP. c10d would ignore --machine_rank (ranks in arrival order)
# and, with same_network: true, also --main_process_ip (torchrun reads no master_addr for c10d), while its one
# advantage -- restarting a failed worker group in place -- would rerun train.py without resuming; requeue does that.
export MODEL DATASET OUTPUT_DIR ACCELERATE_CONFIG RECIPE_SCRIPT
export MACHINE_LAUNCH_ARGS="--num_machines $NNODES --num_processes $((NNODES * GPUS_PER_NODE)) \
--main_process_ip $MAIN_PROCESS_IP --main_process_port $MAIN_PROCESS_PORT --rdzv_backend static"
# The launcher (torchrun's agent) ignores SIGUSR1: Slurm signals every process of the step, and by default SIGUSR1
# kills the agent at once, which ends the step and kills the ranks in the middle of writing their checkpoint. The
# ranks replace the inherited "ignore" with train.py's handler when training starts.
NODE_LAUNCH='trap "" USR1; LAUNCH_ARGS="--machine_rank $SLURM_PROCID $MACHINE_LAUNCH_ARGS" exec bash "$RECIPE_SCRIPT" "$@"'

status=0
srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$NODE_LAUNCH" node-launch \
"${RESUME[@]}" "$@" || status=$?

if [[ -f "$PREEMPTED_NOTE" && "$(note_fingerprint)" != "$note_before" ]]; then
  restarts=${SLURM_RESTART_COUNT:-0}
  if (( restarts < MAX_REQUEUES )); then
    echo "preempted: requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most $MAX_REQUEUES); it will" \
         "resume from the newest complete checkpoint in $OUTPUT_DIR"
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "preempted, but job $SLURM_JOB_ID was already requeued $restarts times (MAX_REQUEUES=$MAX_REQUEUES), so" \
         "it is not requeued again. Fix: submit it again (it resumes from $OUTPUT_DIR) or raise MAX_REQUEUES." >&2
  fi
  exit 75
fi
exit "$status"
