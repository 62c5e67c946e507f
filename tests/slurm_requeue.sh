#!/usr/bin/env bash
# A real Slurm requeue (Debian's slurmctld, slurmd and munge, which scripts/setup.sh installs): a
# private one-node cluster of this machine, run by this user in a scratch folder (its own munge
# key and socket, its own ports), takes a batch job that trains with `srun engine --resume last`.
# SIGUSR1 reaches the job step as Slurm sends it before a time limit or a preemption (here by
# `scancel --signal=USR1`): the engine saves last.ckpt and runs `scontrol requeue`; Slurm queues
# the job again, starts it with SLURM_RESTART_COUNT=1, and it resumes by itself. It ends with
# exit 0, in the same run folder, with the weights of an uninterrupted run, bit for bit.
#   slurm_requeue.sh <engine> <test plugin dir> <python with torch> <scratch dir>
# Exits 77 (skipped) when the Slurm daemons are not installed.
set -euo pipefail
engine=$(realpath "$1"); plugins=$(realpath "$2"); python=$3; work=$(realpath -m "$4")
for tool in munged slurmctld slurmd sbatch scontrol scancel; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin command -v "$tool" >/dev/null ||
    { echo "SKIP: $tool is not installed (scripts/setup.sh installs slurmctld, slurmd, slurm-client and munge)"; exit 77; }
done
export PATH=$PATH:/usr/sbin
rm -rf "$work"; mkdir -p "$work"/{state,spool,job,reference}; chmod 700 "$work"; cd "$work"
# Nothing of an enclosing Slurm job may leak into this cluster's commands.
while read -r v; do unset "$v"; done < <(env | sed -n 's/^\(SLURM_[A-Z_]*\)=.*/\1/p')

pids=()
cleanup() {
  scancel --quiet "${job:-0}" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in job/job.out slurmctld.log slurmd.log; do echo "--- $f"; tail -n 30 "$f" 2>/dev/null || true; done; exit 1; }
wait_for() {  # wait_for <seconds> <what> <command...>
  local limit=$1 what=$2; shift 2
  for ((i = 0; i < limit * 5; ++i)); do "$@" && return 0; sleep 0.2; done
  fail "$what (waited ${limit} s)"
}
# A free port below the kernel's ephemeral range (as tests/support.cpp's free_port): no port the
# system hands out to another process can take it before the daemon binds it.
free_port() {
  python3 -c 'import random, socket
for _ in range(200):
    p = random.randint(20000, 31999)
    try:
        socket.socket().bind(("127.0.0.1", p))
    except OSError:
        continue
    print(p)
    break'
}

head -c 1024 /dev/urandom > munge.key; chmod 600 munge.key
munged --foreground --force --key-file="$work/munge.key" --socket="$work/munge.sock" --pid-file="$work/munged.pid" \
  --log-file="$work/munged.log" --seed-file="$work/munged.seed" >> daemons.log 2>&1 & pids+=($!)
wait_for 10 "munged did not start" test -S "$work/munge.sock"

user=$(id -un); host=$(hostname -s)
ctld_port=$(free_port)
while slurmd_port=$(free_port); [ "$slurmd_port" = "$ctld_port" ]; do :; done
cat > slurm.conf <<CONF
ClusterName=ember-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthInfo=socket=$work/munge.sock
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobRequeue=1
NodeName=ember-test NodeHostname=$host NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$work/slurm.conf
slurmctld -D -i >> daemons.log 2>&1 & pids+=($!)
slurmd -D -N ember-test >> daemons.log 2>&1 & pids+=($!)
wait_for 60 "the node did not come up" bash -c 'sinfo -h -o %t 2>/dev/null | grep -q idle'

cat > run.toml <<'TOML'
[trainer]
accelerator = "cpu"
max_epochs = -1
max_steps = 200
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 32
hidden = [23, 17]
num_classes = 4
[data]
name = "synthetic"
shape = [32]
num_classes = 4
num_train = 240
num_val = 24
num_test = 0
batch_size = 8
shuffle = true
[optimizer]
name = "adam"
lr = 0.01
[checkpoint]
every_n_train_steps = 10
[sleeper]
seconds = [0.04]
TOML
cp run.toml job/; sed "/^\[sleeper\]/,\$d" run.toml > reference/run.toml  # the sleeper only paces the job
# README's job script: USR1 to the tasks before the time limit, requeue allowed, one log.
cat > job/job.sh <<JOB
#!/bin/bash
#SBATCH --job-name=ember-requeue
#SBATCH --ntasks=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=$work/job/job.out
echo "job start SLURM_RESTART_COUNT=\${SLURM_RESTART_COUNT:-0}"
OMP_NUM_THREADS=1 srun "$engine" --plugin-path "$plugins" --plugins sleeper --resume last run.toml
echo "engine exit \$?"
JOB
job=$(sbatch --parsable --chdir="$work/job" job/job.sh)
state() { scontrol show job "$job" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
restarts() { scontrol show job "$job" 2>/dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p'; }
wait_for 60 "the job saved no checkpoint" test -e job/runs/run/version_0/checkpoints/last.ckpt
scancel --signal=USR1 "$job"
wait_for 60 "the job was not requeued" bash -c "[ \"\$(scontrol show job $job | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p')\" = 1 ]"
# Slurm holds a requeued job for two minutes before it is eligible again: once it is pending,
# make it eligible now.
finished_or_released() {
  local s; s=$(state)
  [ "$s" = PENDING ] && scontrol update jobid="$job" StartTime=now 2>/dev/null
  [ "$s" = COMPLETED ] || [ "$s" = FAILED ] || [ "$s" = CANCELLED ]
}
wait_for 120 "the requeued job did not finish" finished_or_released
[ "$(state)" = COMPLETED ] || fail "the requeued job ended $(state)"
[ "$(restarts)" = 1 ] || fail "expected one restart, Slurm counts $(restarts)"

out=job/job.out
grep -q "job start SLURM_RESTART_COUNT=0" $out || fail "the first start is missing"
grep -q "SIGUSR1 received: finishing this step, saving" $out || fail "the engine did not stop on SIGUSR1"
grep -q "Slurm: scontrol requeue $job: the job is queued again" $out || fail "the engine did not requeue job $job"
grep -q "job start SLURM_RESTART_COUNT=1" $out || fail "the job was not started again"
resumed=$(sed -n 's/.*resumed from runs\/run\/version_0\/checkpoints\/last.ckpt at epoch [0-9]*, step \([0-9]*\).*/\1/p' $out)
[ -n "$resumed" ] && [ "$resumed" -gt 0 ] && [ "$resumed" -lt 200 ] || fail "the restarted job did not resume mid-run (step '$resumed')"
[ "$(grep -c '^engine exit 0' $out)" = 1 ] || fail "the restarted job did not end with exit 0"
[ ! -e job/runs/run/version_1 ] || fail "the restarted job started a run folder of its own"

(cd reference && OMP_NUM_THREADS=1 "$engine" run.toml 2> engine.log) || { cat reference/engine.log; fail "the uninterrupted run failed"; }
"$python" -W ignore - job/runs/run/version_0/checkpoints/last.ckpt reference/runs/run/version_0/checkpoints/last.ckpt <<'PY' || fail "weights differ"
import sys
import torch

a, b = (torch.load(p) for p in sys.argv[1:3])
assert a["global_step"] == b["global_step"] == 200, (a["global_step"], b["global_step"])
sa, sb = a["state_dict"], b["state_dict"]
assert sa.keys() == sb.keys() and len(sa) > 0, (sa.keys(), sb.keys())
for k in sa:
    assert torch.equal(sa[k], sb[k]), f"{k} differs by {(sa[k] - sb[k]).abs().max().item()}"
print(f"the requeued job ends with the uninterrupted run's weights ({len(sa)} tensors, bit for bit)")
PY
echo "PASS: Slurm job $job stopped by SIGUSR1 at step $resumed, requeued itself, resumed and ended as the uninterrupted run"
