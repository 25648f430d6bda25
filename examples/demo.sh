#!/usr/bin/env bash
# The main job, end to end on a real (throwaway) Slurm cluster on this machine:
#   1. `slurmft devcluster up` (munge, MariaDB + slurmdbd, slurmctld, 3 slurmd on 127.0.0.1);
#   2. submit sbatch_templates/train.sbatch running examples/train_gpt.py (FSDP2, gloo) on 2 nodes;
#   3. start `slurmft watch JOB` (the requeue daemon) beside it;
#   4. once a checkpoint is committed, preempt it (`scancel --signal=USR2 --batch`, what Slurm sends
#      at a time limit): the ranks agree on one emergency checkpoint, exit "requeue me", the job
#      requeues itself, and the watcher skips Slurm's ~120 s requeue delay (`StartTime=now`);
#   5. once the resumed run has checkpointed again, crash it (SIGKILL to every training process):
#      the watcher requeues it and starts it at once;
#   6. the run resumes from its newest checkpoint and runs to the end; the journal shows that no
#      step was lost and that every redone step has the same loss as before the crash; `slurmft
#      status` shows what each fault cost; `slurmft ckpt ls/verify` show the checkpoints;
#   7. the cluster is torn down (also on failure or Ctrl-C).
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
WATCH_PID=
cleanup() {  # every step may fail (set -e must not skip the teardown)
    if [ -n "$WATCH_PID" ]; then kill "$WATCH_PID" 2>/dev/null || true; fi
    "$SLURMFT" devcluster down --dir "$DEMO_DIR/cluster" >/dev/null 2>&1 || true
}
trap cleanup EXIT
"$SLURMFT" devcluster status --dir "$DEMO_DIR/cluster"

RUN_DIR=$DEMO_DIR/run
mkdir -p "$RUN_DIR"
say "submitting train.sbatch: examples/train_gpt.py, $STEPS steps on 2 nodes, checkpoint every 10"
JOB=$(SLURMFT_RUN_DIR=$RUN_DIR SLURMFT_PYTHON=$PY OMP_NUM_THREADS=1 \
    sbatch --parsable --nodes=2 --output="$DEMO_DIR/job.log" --chdir="$DEMO_DIR" \
    "$REPO/sbatch_templates/train.sbatch" "$REPO/examples/train_gpt.py" --tiny --steps "$STEPS" \
    --ckpt-every 10 --step-sleep 1)
echo "job $JOB"

checkpoints_since() {  # checkpoints_since N: a checkpoint newer than step N is committed
    "$PY" - "$RUN_DIR" "$1" <<'EOF' && return 0
import sys
from slurmft.rundir import RunDir
sys.exit(0 if [s for s in RunDir(sys.argv[1]).committed_steps() if s > int(sys.argv[2])] else 1)
EOF
    [ -n "$(squeue -h -j "$JOB" -o %T 2>/dev/null)" ] && return 1
    tail -n 20 "$DEMO_DIR/job.log" >&2
    die "job $JOB ended before the checkpoint it was waiting for"
}
newest_checkpoint() {
    "$PY" -c 'import sys; from slurmft.rundir import RunDir; print(max(RunDir(sys.argv[1]).committed_steps()))' "$RUN_DIR"
}
has_comment() { squeue -h -j "$JOB" -o %k 2>/dev/null | grep -q SLURMFT_RUN_DIR=; }
# running_again N: the job is RUNNING in its restart N (or later)
running_again() {
    [ "$(squeue -h -j "$JOB" -o %T 2>/dev/null)" = RUNNING ] || return 1
    [ "$(scontrol show job "$JOB" -o | grep -o 'Restarts=[0-9]*' | cut -d= -f2)" -ge "$1" ]
}

wait_for 120 "the job to name its run dir (job comment)" has_comment
say "starting slurmft watch $JOB (log: $DEMO_DIR/watch.log)"
"$SLURMFT" watch "$JOB" --poll 1 -v > "$DEMO_DIR/watch.log" 2>&1 &
WATCH_PID=$!

wait_for 240 "the first committed checkpoint" checkpoints_since 0
say "preempting job $JOB (USR2 to the batch script, as at a time limit)"
scancel --signal=USR2 --batch "$JOB"
wait_for 180 "the job to requeue itself and the watcher to start it again" running_again 1
say "job $JOB runs again (restart 1): the watcher sent StartTime=now"

AFTER=$(newest_checkpoint)
wait_for 240 "a checkpoint newer than step $AFTER" checkpoints_since "$AFTER"
say "crashing job $JOB: SIGKILL to every training process (no handler runs, no checkpoint is saved)"
"$PY" - "$JOB" "$REPO/examples/train_gpt.py" <<'EOF'
import os, signal, sys
from pathlib import Path
job, script = sys.argv[1], sys.argv[2].encode()
killed = 0
for proc in Path("/proc").iterdir():
    if not proc.name.isdigit():
        continue
    try:
        env = (proc / "environ").read_bytes().split(b"\0")
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        continue
    if f"SLURM_JOB_ID={job}".encode() in env and script in argv[1:3]:  # a rank: python -u SCRIPT
        os.kill(int(proc.name), signal.SIGKILL)
        killed += 1
print(f"killed {killed} training processes")
sys.exit(0 if killed else 1)
EOF
wait_for 180 "the watcher to requeue the crashed job and start it again" running_again 2
say "job $JOB runs again (restart 2): the watcher requeued it and sent StartTime=now"

wait_for 600 "the run to finish (DONE)" test -e "$RUN_DIR/DONE"
wait_for 60 "slurmft watch to see the run finished" bash -c "! kill -0 $WATCH_PID 2>/dev/null"
WATCH_PID=

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
losses = collections.defaultdict(list)
for e in events:
    if e.kind == journal.LOSS:
        losses[e.get("step")].append(e.get("loss"))
redone = sorted(s for s, seen in losses.items() if len(seen) > 1)
differ = sorted(s for s in redone if len(set(losses[s])) > 1)
missing = sorted(set(range(1, steps + 1)) - set(losses))
restarts = max((e.get("restart_count", 0) for e in events), default=0)
faults = [e.get("cause") for e in events if e.kind == "fault_detected"]
print(f"steps with a loss: {len(losses)} of {steps}; missing: {missing or 'none'}; redone after "
      f"the crash: {redone or 'none'} (same loss each time: {'no ' + str(differ) if differ else 'yes'}); "
      f"restarts: {restarts}; faults the watcher handled: {faults}")
sys.exit(1 if missing or differ or restarts < 2 or faults != ["preempted", "crash"] else 0)
EOF

say "slurmft status: what each fault cost"
COLUMNS=${COLUMNS:-150} "$SLURMFT" status "$RUN_DIR" --no-slurm

say "checkpoints"
"$SLURMFT" ckpt ls "$RUN_DIR"
"$SLURMFT" ckpt verify "$RUN_DIR"
say "demo finished: job $JOB was preempted and crashed; slurmft watch brought it back each time, without losing a step"
echo "files: $DEMO_DIR (job log: $DEMO_DIR/job.log)"
