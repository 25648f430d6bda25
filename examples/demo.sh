#!/usr/bin/env bash
# The main job, end to end on a real (throwaway) Slurm cluster on this machine:
#   1. `slurmft devcluster up` (munge, MariaDB + slurmdbd, slurmctld, 3 slurmd on 127.0.0.1);
#   2. submit sbatch_templates/train.sbatch running examples/train_gpt.py (FSDP2, gloo) on 2 nodes;
#   3. once a checkpoint is committed, preempt it (`scancel --signal=USR2 --batch`, what Slurm sends
#      at a time limit): the ranks agree on one emergency checkpoint, exit "requeue me", and the
#      template requeues the job;
#   4. skip Slurm's ~120 s requeue delay with `StartTime=now` (what `slurmft watch` will do);
#   5. the job resumes from the emergency checkpoint and runs to the end; the journal shows that no
#      step was lost or repeated; `slurmft ckpt ls/verify` show the checkpoints;
#   6. the cluster is torn down (also on failure or Ctrl-C).
# Run as root from the repository after `make install`:  make demo   (DEMO_DIR=... to keep files)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=$REPO/.venv/bin/python
SLURMFT=$REPO/.venv/bin/slurmft
DEMO_DIR=${DEMO_DIR:-$(mktemp -d /tmp/slurmft-demo.XXXXXX)}
STEPS=${DEMO_STEPS:-40}

say() { printf '\n== %s\n' "$*"; }
die() { echo "demo: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (it starts Slurm daemons)"
[ -x "$SLURMFT" ] || die "$SLURMFT missing: run 'make install' first"

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every second until it succeeds.
wait_for() {
    local limit=$1 what=$2; shift 2
    local t=0
    until "$@" >/dev/null; do
        t=$((t + 1)); [ "$t" -le "$limit" ] || die "timed out after ${limit}s waiting for $what"
        sleep 1
    done
}

say "starting a 3-node devcluster in $DEMO_DIR/cluster"
eval "$("$SLURMFT" devcluster up --nodes 3 --dir "$DEMO_DIR/cluster")"
trap '"$SLURMFT" devcluster down --dir "$DEMO_DIR/cluster" >/dev/null 2>&1 || true' EXIT
"$SLURMFT" devcluster status --dir "$DEMO_DIR/cluster"

RUN_DIR=$DEMO_DIR/run
mkdir -p "$RUN_DIR"
say "submitting train.sbatch: examples/train_gpt.py, $STEPS steps on 2 nodes, checkpoint every 10"
JOB=$(SLURMFT_RUN_DIR=$RUN_DIR SLURMFT_PYTHON=$PY OMP_NUM_THREADS=1 \
    sbatch --parsable --nodes=2 --output="$DEMO_DIR/job.log" --chdir="$DEMO_DIR" \
    "$REPO/sbatch_templates/train.sbatch" "$REPO/examples/train_gpt.py" --tiny --steps "$STEPS" \
    --ckpt-every 10 --step-sleep 1)
echo "job $JOB"

has_checkpoint() {
    "$PY" - "$RUN_DIR" <<'EOF' && return 0
import sys
from slurmft.rundir import RunDir
sys.exit(0 if RunDir(sys.argv[1]).committed_steps() else 1)
EOF
    [ -n "$(squeue -h -j "$JOB" -o %T 2>/dev/null)" ] && return 1
    tail -n 20 "$DEMO_DIR/job.log" >&2
    die "job $JOB ended before its first checkpoint"
}
wait_for 240 "the first committed checkpoint" has_checkpoint
say "preempting job $JOB (USR2 to the batch script, as at a time limit)"
scancel --signal=USR2 --batch "$JOB"

pending_and_settled() { [ "$(squeue -h -j "$JOB" -o %T 2>/dev/null)" = PENDING ]; }
wait_for 180 "the job to requeue itself" pending_and_settled
sleep 2  # a release within the second of the requeue makes slurmd revoke the job credential
say "job $JOB is PENDING again; StartTime=now skips Slurm's ~120 s requeue delay"
scontrol update "JobId=$JOB" StartTime=now

wait_for 600 "the run to finish (DONE)" test -e "$RUN_DIR/DONE"
wait_for 60 "job $JOB to leave the queue" bash -c "[ \"\$(squeue -h -j $JOB -o %T)\" != RUNNING ]"

say "what the journal says"
"$PY" - "$RUN_DIR" "$STEPS" <<'EOF'
import collections, sys
from pathlib import Path
from slurmft import journal
run, steps = Path(sys.argv[1]), int(sys.argv[2])
events = journal.read_events(run / "events.jsonl")
for e in events:
    if e.kind in (journal.SEGMENT_START, journal.SEGMENT_END, journal.PREEMPTION,
                  journal.CHECKPOINT_COMMITTED):
        keep = {k: v for k, v in e.fields.items() if k in (
            "restart_count", "world_size", "restored_step", "step", "exit_code", "nodes", "reason")}
        print(f"  {e.kind:22s} {keep}")
losses = collections.Counter(e.get("step") for e in events if e.kind == journal.LOSS)
repeated = sorted(s for s, n in losses.items() if n > 1)
missing = sorted(set(range(1, steps + 1)) - set(losses))
restarts = max((e.get("restart_count", 0) for e in events), default=0)
print(f"steps with a loss: {len(losses)} of {steps}; repeated: {repeated or 'none'}; "
      f"missing: {missing or 'none'}; restarts: {restarts}")
sys.exit(1 if repeated or missing or restarts < 1 else 0)
EOF

say "checkpoints"
"$SLURMFT" ckpt ls "$RUN_DIR"
"$SLURMFT" ckpt verify "$RUN_DIR"
say "demo finished: job $JOB was preempted, checkpointed, requeued and resumed without losing a step"
echo "files: $DEMO_DIR (job log: $DEMO_DIR/job.log)"
