"""scripts/slurm_train.sh's job-level restarts, with stand-ins for srun, scontrol and scancel
on PATH: a run stopped by a signal (rank 0's exit 75, or USR1 to the batch script before the
time limit) is requeued; a failed run (a lost node) is requeued at most DCVIT_MAX_REQUEUES
times in a row; a user error (exit 2) or a Ctrl-C (exit 130) is not."""
import os
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "slurm_train.sh")

# srun: logs its arguments, then acts as $STUB_RUN says: "exit CODE" (rank 0 wrote CODE),
# "lost" (no exit file: rank 0's node was lost), or "wait" (trains until scancel stops it)
SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$STUB_LOG"
case "$STUB_RUN" in
  exit*) echo "${STUB_RUN#exit }" > "$DCVIT_EXIT_FILE"; exit 1 ;;
  lost) exit 1 ;;
  wait) echo $$ > "$STUB_DIR/srun.pid"; trap 'echo 75 > "$DCVIT_EXIT_FILE"; exit 1' USR1
        while true; do sleep 0.1; done ;;
esac
"""
SCONTROL = """#!/usr/bin/env bash
if [[ $1 == show ]]; then echo node1; else echo "scontrol $*" >> "$STUB_LOG"; fi
"""
SCANCEL = """#!/usr/bin/env bash
echo "scancel $*" >> "$STUB_LOG"
kill -USR1 "$(cat "$STUB_DIR/srun.pid")"
"""


@pytest.fixture
def job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    submit = tmp_path / "submit"
    (submit / "scripts").mkdir(parents=True)
    (submit / "scripts" / "env.sh").write_text("")           # the project's venv: not needed
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", SLURM_SUBMIT_DIR=str(submit),
               STUB_LOG=str(tmp_path / "calls"), STUB_DIR=str(tmp_path))

    def start(run):
        return subprocess.Popen(["bash", SCRIPT, "configs/x.yaml", "epochs=3"], env=dict(env, STUB_RUN=run),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def calls():
        path = tmp_path / "calls"
        lines = path.read_text().splitlines() if path.exists() else []
        path.unlink(missing_ok=True)
        return lines
    return start, calls, tmp_path


def _finish(proc):
    out, _ = proc.communicate(timeout=60)
    return out


def test_a_stopped_run_is_requeued(job):
    start, calls, _ = job
    out = _finish(start("exit 75"))
    srun, *rest = calls()
    assert "--max-restarts=0" in srun and "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in srun
    assert "resume=auto epochs=3" in srun
    assert rest == ["scontrol requeue 77"], out


def test_usr1_before_the_time_limit_stops_the_step_and_requeues(job):
    start, calls, tmp_path = job
    proc = start("wait")
    deadline = time.time() + 30
    while not (tmp_path / "srun.pid").exists() and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out = _finish(proc)
    assert calls()[1:] == ["scancel --signal=USR1 77.0", "scontrol requeue 77"], out
    assert "stopped by USR1" in out


def test_a_lost_node_is_requeued_a_bounded_number_of_times_and_a_user_error_never(job):
    start, calls, tmp_path = job
    for attempt in range(1, 4):
        out = _finish(start("lost"))
        assert calls()[1:] == ["scontrol requeue 77"], out
        assert f"restart {attempt} of 3" in out
    _finish(start("lost"))
    assert calls()[1:] == []                                   # the fourth failure in a row
    (tmp_path / "submit" / ".dcvit-failures-77").unlink()
    _finish(start("exit 2"))
    assert calls()[1:] == []
    _finish(start("exit 130"))                                 # Ctrl-C: saved, and stopped
    assert calls()[1:] == []
