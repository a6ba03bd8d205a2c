"""Bad input to the library and its scripts, found by trying to break them: each is refused
with a message naming the value and the fix (exit status 2 for the command-line tools)."""

import pytest
import timm
import torch

import dcvit
import dcvit.report.cli as report_cli

TINY = dict(img_size=32, patch_size=8, depth=2, embed_dim=24, num_heads=2)


def test_save_weights_refuses_a_name_that_hides_the_format(tmp_path):
    model = timm.create_model("dcvit_tiny", **TINY)
    with pytest.raises(ValueError, match=r"name the file '.*w.safetensors'"):
        dcvit.save_weights(model, tmp_path / "w.pth")
    assert not list(tmp_path.iterdir())


def test_misnamed_safetensors_file_still_loads(tmp_path):
    """A safetensors file under a .pth name (as older versions wrote it) is read by content."""
    torch.manual_seed(0)
    model = timm.create_model("dcvit_tiny", **TINY)
    path = dcvit.save_weights(model, tmp_path / "w.safetensors")
    misnamed = path.rename(tmp_path / "w.pth")
    fresh = dcvit.load_weights(timm.create_model("dcvit_tiny", **TINY), misnamed)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


@pytest.mark.parametrize("kwargs, message", [
    (dict(query_wise="no"), "query_wise='no' must be True or False"),
    (dict(static_proj=1), "static_proj=1 must be True or False"),
    (dict(dcmha_layers=1), r"dcmha_layers=1 must be a list of attention-layer indices, e.g. dcmha_layers=\[1\]"),
])
def test_dcmha_options_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        timm.create_model("dcvit_tiny", **TINY, **kwargs)


@pytest.mark.parametrize("make, message", [("file", "is a file, not a directory"),
                                           ("under_file", "cannot be written")])
def test_report_refuses_an_unusable_out_before_counting(tmp_path, capsys, monkeypatch, make, message):
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" if make == "file" else tmp_path / "f" / "sub"
    monkeypatch.setattr(report_cli, "param_efficiency_report",
                        lambda *a, **k: pytest.fail("counted before checking --out"))
    with pytest.raises(SystemExit) as exc:
        report_cli.main(["--models", "dcvit_tiny", "--out", str(out)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
