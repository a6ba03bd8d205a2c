"""Trainer faults of the files a run writes besides its checkpoints, and of the exit code it
leaves: DCVIT_EXIT_FILE that cannot be written (docs/training_fault_cases.md, round 4)."""
import pytest

from train_imagenet.__main__ import main


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
