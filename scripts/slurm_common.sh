# Shared part of scripts/slurm_single_node.sbatch and scripts/slurm_multi_node.sbatch: sourced by them from
# the repository root, not run on its own.
#
#   finetune_rendezvous            head node, MASTER_ADDR and MASTER_PORT for the job
#   finetune_hostfile <slots>      DeepSpeed hostfile ("<host> slots=<n>", one line per node of the job)
#   finetune_launch <command...>   run the launcher in the background; on USR1/TERM forward the signal to
#                                  every rank; return once every rank has exited (not just the launcher);
#                                  after a USR1 stop, requeue the job (it resumes by itself)
#
# Why the forwarding: `#SBATCH --signal=B:USR1@<seconds>` signals only this batch shell, and neither the
# deepspeed launcher nor torchrun passes SIGUSR1 on to its ranks (SIGUSR1 would even kill them). The trap
# runs `python -m finetune.lifecycle.preemption forward USR1 <launcher pid>`, which signals the ranks under the
# launcher and any srun (srun forwards SIGUSR1 to its tasks on every node). The ranks agree on a step
# through one all-reduce, save a complete checkpoint and exit with 128+10; the job is then requeued with
# `scontrol requeue`, and the requeued job (SLURM_RESTART_COUNT > 0) continues from that checkpoint.
# SIGTERM (scancel, preemption) reaches every process of the job from Slurm itself; the ranks checkpoint
# in the KillWait grace period (30 s by default) and the job is not requeued by this script (Slurm does it
# for preemption with PreemptMode=REQUEUE; the requeued job resumes the same way).
#
# Why the launcher runs under `python -m finetune.lifecycle.preemption run --`: on SIGTERM the deepspeed launcher
# exits at once (status 143) while the ranks are still writing their checkpoint, and a batch shell that
# waited on the launcher alone would end the job step (or let it be requeued) mid-save. That wrapper is a
# child subreaper: the ranks (orphaned or not, or srun and its tasks) are re-parented to it, and it
# returns only once every one of them has exited, so the job ends after the checkpoint is COMPLETE (or
# after Slurm's KillWait, when Slurm kills everything).

finetune_log() {
    echo "[finetune $(date '+%F %T.%3N')] $*"
}

finetune_rendezvous() {
    FINETUNE_HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_ADDR=${MASTER_ADDR:-$FINETUNE_HEAD_NODE}
    # A port per job id, below the ephemeral range; set MASTER_PORT yourself if it collides.
    export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
    finetune_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) nodes $SLURM_JOB_NODELIST;" \
        "head $FINETUNE_HEAD_NODE; master $MASTER_ADDR:$MASTER_PORT"
}

finetune_hostfile() {
    local slots=$1
    FINETUNE_HOSTFILE=${FINETUNE_HOSTFILE:-${TMPDIR:-/tmp}/finetune-$SLURM_JOB_ID.hostfile}
    scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$slots/" > "$FINETUNE_HOSTFILE"
    finetune_log "hostfile $FINETUNE_HOSTFILE: $(tr '\n' ';' < "$FINETUNE_HOSTFILE")"
}

finetune_pipeline_placement() {
    # With parallel.pipeline_parallel_size=P among the overrides: log which nodes hold each stage (stage s holds
    # ranks [s x world/P, (s + 1) x world/P), ranks numbered node by node), and warn when a stage straddles a node
    # boundary while another shares a node (its data-parallel all-reduce then crosses nodes).
    local gpus=$1 nodes=$2 pp=1 arg
    shift 2
    for arg in "$@"; do
        case $arg in parallel.pipeline_parallel_size=*) pp=${arg#*=} ;; esac
    done
    [ "$pp" -gt 1 ] 2>/dev/null || return 0
    local world=$((gpus * nodes)) hosts s first last
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    local per=$((world / pp))
    for ((s = 0; s < pp; s++)); do
        first=$((s * per / gpus)) last=$(((s + 1) * per / gpus - ((s + 1) * per % gpus == 0 ? 1 : 0)))
        finetune_log "pipeline stage $s: ranks $((s * per))-$(((s + 1) * per - 1)) on ${hosts[*]:first:last-first+1}"
    done
    if [ $((per % gpus)) -ne 0 ] && [ $((gpus % per)) -ne 0 ]; then
        finetune_log "warning: $per ranks a stage neither fill whole nodes of $gpus nor divide one: a stage's" \
            "data-parallel all-reduce crosses nodes; choose parallel.pipeline_parallel_size dividing $nodes nodes"
    fi
}

_finetune_forward() {
    local sig=$1
    [ "$sig" = USR1 ] && _FINETUNE_GOT_USR1=1
    finetune_log "batch shell got SIG$sig: forwarding it to the ranks (they checkpoint and stop)"
    python -m finetune.lifecycle.preemption forward "$sig" "$_FINETUNE_PID" || true
}

finetune_launch() {
    finetune_log "launch: $*"
    python -m finetune.lifecycle.preemption run -- "$@" &
    _FINETUNE_PID=$!
    trap '_finetune_forward USR1' USR1
    trap '_finetune_forward TERM' TERM
    local rc
    while :; do
        rc=0
        wait "$_FINETUNE_PID" || rc=$?
        # wait also returns (>128) when a trapped signal arrives; go on waiting while the launcher runs
        kill -0 "$_FINETUNE_PID" 2>/dev/null || break
    done
    trap - USR1 TERM
    finetune_log "launcher and ranks exited with status $rc"
    if [ -n "${_FINETUNE_GOT_USR1:-}" ] && [ "$rc" -ne 0 ]; then
        if [ "${SLURM_RESTART_COUNT:-0}" -lt "${FINETUNE_MAX_RESTARTS:-1000}" ]; then
            finetune_log "requeueing job $SLURM_JOB_ID: the requeued job resumes from the latest complete checkpoint"
            scontrol requeue "$SLURM_JOB_ID"
            return 0
        fi
        finetune_log "not requeueing: SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT} reached FINETUNE_MAX_RESTARTS"
    fi
    return "$rc"
}
