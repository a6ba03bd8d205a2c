"""Sharing through timm's Hugging Face Hub format, offline: save_for_hf + "local-dir:" and
push_to_hf_hub + "hf-hub:" (the upload lands in a local Hub cache, read in offline mode)."""
import json
import shutil

import huggingface_hub
import pytest
import timm
import torch
from timm.models import push_to_hf_hub, save_for_hf

import dcvit
from dcvit import DCMHA

OPTIONS = dict(rank=1, key_wise=False, static_proj=True, dcmha_layers=[0, 2])


def _model():
    torch.manual_seed(0)
    model = timm.create_model("dcvit_tiny", img_size=32, depth=3, num_classes=5, **OPTIONS).eval()
    with torch.no_grad():                              # not the initial values (static starts at 0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _assert_same_model(loaded, model):
    assert [type(b.attn) for b in loaded.blocks] == [type(b.attn) for b in model.blocks]
    assert [b.attn.options for b in loaded.blocks if isinstance(b.attn, DCMHA)] == \
        [b.attn.options for b in model.blocks if isinstance(b.attn, DCMHA)]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), model(x))


def test_model_args_describe_the_architecture():
    args = dcvit.model_args(_model())
    assert args["dcmha_layers"] == [0, 2] and args["rank"] == 1 and args["key_wise"] is False
    assert args["static_proj"] is True and args["img_size"] == [32, 32] and args["depth"] == 3
    json.dumps(args)
    with pytest.raises(TypeError, match="expects a DCViT"):
        dcvit.model_args(torch.nn.Linear(2, 2))


def test_save_for_hf_and_local_dir_round_trip(tmp_path):
    model = _model()
    save_for_hf(model, tmp_path, model_args=dcvit.model_args(model), safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "dcvit_tiny_patch16_224"
    assert config["model_args"]["dcmha_layers"] == [0, 2]
    _assert_same_model(timm.create_model(f"local-dir:{tmp_path}", pretrained=True), model)


class _LocalHub:
    """HfApi's upload side, writing each pushed folder into a Hub cache as a download would."""

    def __init__(self, cache):
        self.cache = cache

    def create_repo(self, repo_id, **kwargs):
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def file_exists(self, repo_id, filename, **kwargs):
        return False

    def upload_folder(self, repo_id, folder_path, **kwargs):
        repo = self.cache / ("models--" + repo_id.replace("/", "--"))
        commit = "0" * 40
        shutil.copytree(folder_path, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        return commit


def test_push_to_hf_hub_and_hf_hub_round_trip(tmp_path, monkeypatch):
    hub = _LocalHub(tmp_path / "hub-cache")
    for name in ("create_repo", "file_exists", "upload_folder"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, lambda self, *a, _n=name, **k: getattr(hub, _n)(*a, **k))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # no network
    model = _model()
    push_to_hf_hub(model, "someone/dcvit-tiny-test", model_args=dcvit.model_args(model),
                   safe_serialization="both")
    snapshot = next((hub.cache / "models--someone--dcvit-tiny-test" / "snapshots").iterdir())
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in snapshot.iterdir()}
    _assert_same_model(timm.create_model("hf-hub:someone/dcvit-tiny-test", pretrained=True), model)


def test_save_pretrained_writes_what_timm_and_transformers_load(tmp_path):
    model = _model()
    names = ["a", "b", "c", "d", "e"]
    folder = dcvit.save_pretrained(model, tmp_path / "out", label_names=names)
    config = json.loads((folder / "config.json").read_text())
    assert "num_classes" not in config["model_args"] and config["num_classes"] == 5   # transformers passes its own
    assert config["model_args"]["dcmha_layers"] == [0, 2] and config["label_names"] == names
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]                     # the model's size, not 224
    card = (folder / "README.md").read_text()
    assert "import dcvit" in card and "Please upgrade timm" in card
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert loaded.num_classes == 5 and loaded.pretrained_cfg["label_names"] == names
    _assert_same_model(loaded, model)
    with pytest.raises(ValueError, match="3 names for a model with 5 classes"):
        dcvit.save_pretrained(model, tmp_path / "bad", label_names=names[:3])


def test_save_pretrained_lays_out_the_weights_aligned_for_a_memory_map(tmp_path):
    """Valid safetensors (its own loader reads it back exactly), and every tensor whose size is
    a multiple of 64 bytes (all weight matrices) starts 64-byte aligned in the file."""
    from safetensors import safe_open

    model = _model().to(torch.bfloat16)
    model.head.bias.data[:] = torch.arange(5)         # head.bias (10 bytes) sorts before head.weight
    dcvit.save_pretrained(model, tmp_path)
    path = tmp_path / "model.safetensors"
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_len])
    assert (8 + header_len) % 64 == 0 and header["__metadata__"] == {"format": "pt"}
    state = model.state_dict()
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(state)
        for name, tensor in state.items():
            assert torch.equal(f.get_tensor(name), tensor) and f.get_tensor(name).dtype == torch.bfloat16
    aligned = [n for n, t in state.items() if t.numel() * t.element_size() % 64 == 0]
    assert "head.weight" in aligned and "blocks.0.attn.qkv.weight" in aligned
    assert all(header[n]["data_offsets"][0] % 64 == 0 for n in aligned)
