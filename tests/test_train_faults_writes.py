"""Trainer faults of the files a run writes besides its checkpoints, and of the exit code it
leaves: a directory in the place of a result file, a record or result whose write the file
system refuses (then resume=auto writes it, or for --eval-only the same command again), its
config.yaml refused at start, a checkpoint larger than ``ulimit -f``, and DCVIT_EXIT_FILE that
cannot be written (docs/training_fault_cases.md, round 4)."""
import errno
import os

import pytest

import train_imagenet.logs as logs_mod
import train_imagenet.results as results_mod
import train_imagenet.trainer as trainer_mod
from fault_cases_trainer import run as run_subprocess
from train_helpers import TINY_RUN, read_records
from train_imagenet.__main__ import main
from train_imagenet.checkpoint import list_checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [*TINY_RUN, "epochs=2", "aug.mixup=0", "aug.cutmix=0"]


@pytest.fixture(scope="module")
def data(digits_shards):
    return digits_shards(48, 20, 24, 20)            # 48 train samples in 2 shards: 6 updates an epoch


def _args(data, out, *extra):
    return [f"data.train={data.root}", f"data.val={data.root}", f"output_dir={out}", *TINY, *extra]


def _error_line(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("name", ["eval.json", "log.jsonl"])
def test_directory_in_place_of_a_run_file_is_refused_at_start(data, tmp_path, capsys, name):
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    assert main(_args(data, out)) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"has a directory named {name}" in line and "remove or rename" in line
    assert not list_checkpoints(str(out)) and not (out / "config.yaml").exists()


def _no_space_for_the_second_record(monkeypatch):
    """log.jsonl takes one record, then its disk is full."""
    appends = []

    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("log.jsonl") and "a" in mode:
            appends.append(path)
            if len(appends) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return open(path, mode, *args, **kwargs)
    monkeypatch.setattr(logs_mod, "open", fake_open, raising=False)


def _read_only_for_eval_json(monkeypatch):
    """output_dir is remounted read-only once the last record is written."""
    real = results_mod.write_json

    def write_json(path, obj):
        if os.path.basename(path) == "eval.json":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(
                os.path.dirname(path), ".eval.json.x1y2.tmp"))     # as mkstemp raises
        return real(path, obj)
    monkeypatch.setattr(results_mod, "write_json", write_json)


def _directory_made_at_eval_json(monkeypatch):
    """A directory is made where eval.json goes while the last epoch is logged."""
    real = trainer_mod.write_epoch_results

    def write_epoch_results(cfg, info, done, *args):
        if done == cfg.epochs:
            os.mkdir(os.path.join(cfg.output_dir, "eval.json"))
        return real(cfg, info, done, *args)
    monkeypatch.setattr(trainer_mod, "write_epoch_results", write_epoch_results)


@pytest.mark.parametrize("fault, logged, said", [
    (_no_space_for_the_second_record, [0], "error: no space left on "),
    (_read_only_for_eval_json, [0, 1], "Read-only file system): output_dir "),
    (_directory_made_at_eval_json, [0, 1], "eval.json: a directory is in its place"),
], ids=["log.jsonl-ENOSPC", "eval.json-EROFS", "eval.json-EISDIR"])
def test_refused_record_write_is_one_line_and_resume_writes_it(data, tmp_path, capsys, monkeypatch,
                                                                fault, logged, said):
    """A record or result that cannot be written ends the run with exit 2 and one line naming
    the file and the newest checkpoint; resume=auto, once the fault is gone, writes what is
    missing: every epoch's record once, and eval.json."""
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        fault(m)
        assert main(_args(data, out, "resume=auto")) == 2
    line = _error_line(capsys.readouterr().err)
    newest = list_checkpoints(str(out))[-1]
    assert said in line and f"the newest: {newest}" in line and "resume=auto" in line
    assert [r["epoch"] for r in read_records(out)] == logged
    assert not (out / "eval.json").is_file()
    if (out / "eval.json").is_dir():
        os.rmdir(out / "eval.json")                     # the user removes it
    assert main(_args(data, out, "resume=auto")) == 0
    assert [r["epoch"] for r in read_records(out)] == [0, 1]
    with open(out / "summary.csv") as f:
        assert [ln.split(",")[0] for ln in f.read().splitlines()] == ["epoch", "0", "1"]
    assert (out / "eval.json").is_file()


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A finished one-epoch run: its last checkpoint, for --eval-only."""
    out = tmp_path_factory.mktemp("trained") / "out"
    assert main(_args(data, out, "epochs=1")) == 0
    return list_checkpoints(str(out))[-1]


def _refuse_config(name, err):
    def fault(monkeypatch):
        """The file system refuses the write of `name` (config.yaml or eval_config.yaml),
        which happens once every check has passed."""
        real = trainer_mod.save_config

        def save_config(cfg, path):
            if os.path.basename(path) == name:
                raise OSError(err, os.strerror(err), path)       # as atomic_write names it
            return real(cfg, path)
        monkeypatch.setattr(trainer_mod, "save_config", save_config)
    return fault


@pytest.mark.parametrize("name, err, said", [
    ("config.yaml", errno.ENOSPC, "error: no space left on "),
    ("eval_config.yaml", errno.EROFS, "Read-only file system): output_dir "),
])
def test_refused_config_write_at_start_is_one_line(data, trained, tmp_path, capsys, monkeypatch,
                                                   name, err, said):
    """config.yaml (eval_config.yaml for --eval-only) that cannot be written is exit 2 with
    one line naming it, not a traceback on rank 0; the fix that follows is the mode's:
    resume=auto for a training run, the same command again for --eval-only."""
    out = tmp_path / "out"
    eval_only = name == "eval_config.yaml"
    extra = ["--eval-only", f"checkpoint={trained}"] if eval_only else []
    with monkeypatch.context() as m:
        _refuse_config(name, err)(m)
        assert main(_args(data, out, *extra)) == 2
    line = _error_line(capsys.readouterr().err)
    assert said in line and str(out / name) in line
    if eval_only:
        assert line.endswith("then run the same --eval-only command again") and "resume" not in line
    else:
        assert line.endswith("then resume=auto") and "the newest: none was saved yet" in line
    assert not list_checkpoints(str(out)) and not (out / name).exists()


def test_refused_eval_json_of_eval_only_says_to_evaluate_again(data, trained, tmp_path, capsys,
                                                               monkeypatch):
    """--eval-only whose eval.json cannot be written: exit 2 with one line whose fix is the
    evaluation run again (there is no run to resume); run again, it writes eval.json."""
    out = tmp_path / "out"
    args = _args(data, out, "--eval-only", f"checkpoint={trained}")
    with monkeypatch.context() as m:
        _read_only_for_eval_json(m)
        assert main(args) == 2
    line = _error_line(capsys.readouterr().err)
    assert "Read-only file system): output_dir " in line and "the checkpoint is unchanged" in line
    assert line.endswith("then run the same --eval-only command again") and "resume" not in line
    assert main(args) == 0 and (out / "eval.json").is_file()


def test_checkpoint_larger_than_ulimit_f_is_one_line(data, tmp_path):
    """RLIMIT_FSIZE (``ulimit -f``) below a checkpoint's size: the write fails with EFBIG,
    which torch's writer wraps in a RuntimeError; exit 2 with one line, no temporary left."""
    out = tmp_path / "out"
    limit = 64 * 1024                                  # a tiny run's checkpoint is ~190 KB
    prelude = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))")
    code, err = run_subprocess(ROOT, _args(data, out, "epochs=1"), prelude=prelude)
    line = _error_line(err)
    assert code == 2, err[-3000:]
    assert f"cannot write {out / 'ckpt-e0001-u00000006.pth'}: it is larger than this process " \
           f"may write (ulimit -f: {limit} bytes" in line and "resume=auto" in line
    assert not list_checkpoints(str(out)) and not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_exit_file_that_cannot_be_written_keeps_the_exit_code(tmp_path, capsys, monkeypatch):
    """The code goes to DCVIT_EXIT_FILE; when that cannot be written (here a file stands where
    its folder should be) a one-line warning says so and the run keeps its own exit code."""
    monkeypatch.delenv("RANK", raising=False)
    code = tmp_path / "code"
    monkeypatch.setenv("DCVIT_EXIT_FILE", str(code))
    assert main(["epochs=0"]) == 2                          # a refused command: exit 2
    assert code.read_text() == "2\n"
    capsys.readouterr()
    monkeypatch.setenv("DCVIT_EXIT_FILE", str(code / "code"))
    assert main(["epochs=0"]) == 2
    err = capsys.readouterr().err
    warning = [ln for ln in err.splitlines() if "DCVIT_EXIT_FILE" in ln]
    assert len(warning) == 1 and str(code / "code") in warning[0] and "exit code 2" in warning[0]
    assert "Traceback" not in err


def test_ctrl_c_before_training_is_recorded_as_130(tmp_path, monkeypatch):
    """Ctrl-C during the start-up checks (nothing to save yet) is Python's KeyboardInterrupt,
    and DCVIT_EXIT_FILE says 130, as for a Ctrl-C while training: slurm_train.sh does not
    requeue it as a failure (1)."""
    import train_imagenet.__main__ as entry
    monkeypatch.delenv("RANK", raising=False)
    code = tmp_path / "code"
    monkeypatch.setenv("DCVIT_EXIT_FILE", str(code))

    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(entry, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main([f"output_dir={tmp_path / 'out'}"])
    assert code.read_text() == "130\n"


def test_summary_csv_cut_in_its_header_gets_a_header_again(tmp_path):
    """A run killed while writing summary.csv's header leaves a line cut short there; once it
    is removed the file is empty, and the next record starts with the header again."""
    (tmp_path / "summary.csv").write_text("epoch,train_lo")
    logs_mod.RunLog(str(tmp_path)).epoch({"epoch": 0, "train_loss": 2.5})
    with open(tmp_path / "summary.csv") as f:
        assert [ln.split(",")[:2] for ln in f.read().splitlines()] == [["epoch", "train_loss"],
                                                                        ["0", "2.5"]]
