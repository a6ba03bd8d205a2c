"""transformers loads what `dcvit.save_pretrained` writes: ``AutoModelForImageClassification``,
``AutoImageProcessor`` and ``pipeline`` give timm's preprocessing and timm's logits, bit for
bit, offline from a local folder. transformers is in the ``test`` extra (and ``hf``)."""
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import dcvit

pytestmark = pytest.mark.slow
CLASSES = ["ant", "bee", "cat", "dog", "eel"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = timm.create_model("dcvit_tiny", img_size=32, depth=3, num_classes=len(CLASSES),
                              rank=1, dcmha_layers=[0, 2]).eval()
    with torch.no_grad():                              # not the initial values (the head starts at 0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = dcvit.save_pretrained(model, tmp_path_factory.mktemp("dcvit-tiny"), label_names=CLASSES)
    return model, folder


def _images():
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 50), (32, 32), (64, 30))]


def _timm_logits(folder, images):
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    with torch.no_grad():   # one image at a time, as the pipeline runs them
        return [model(transform(im)[None])[0] for im in images], transform


def test_auto_classes_load_it_and_give_timms_logits_bit_for_bit(saved):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    model, folder = saved
    hf = AutoModelForImageClassification.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    assert type(hf).__name__ == "TimmWrapperForImageClassification"
    assert hf.config.id2label == dict(enumerate(CLASSES))
    assert [type(b.attn).__name__ for b in hf.timm_model.blocks] == ["DCMHA", "Attention", "DCMHA"]
    images = _images()
    expected, transform = _timm_logits(folder, images)
    for image, logits in zip(images, expected):
        pixels = processor(image, return_tensors="pt")["pixel_values"]
        assert torch.equal(pixels, transform(image)[None])
        with torch.no_grad():
            assert torch.equal(hf(pixel_values=pixels).logits[0], logits)
    batch = torch.stack([transform(im) for im in images])
    with torch.no_grad():
        assert torch.equal(hf(pixel_values=batch).logits, model(batch))


def test_pipeline_gives_timms_logits_and_the_class_names(saved):
    from transformers import pipeline

    _, folder = saved
    classify = pipeline("image-classification", model=str(folder))
    images = _images()
    expected, _ = _timm_logits(folder, images)
    for image, logits in zip(images, expected):
        got = classify(image, top_k=len(CLASSES), function_to_apply="none")
        order = torch.argsort(logits, descending=True).tolist()
        assert [g["label"] for g in got] == [CLASSES[i] for i in order]
        assert [g["score"] for g in got] == [logits[i].item() for i in order]   # float32 -> float, exact


def test_timms_own_config_fails_in_transformers_and_why(saved, tmp_path):
    """What save_pretrained fixes: timm's save_for_hf puts num_classes into model_args."""
    from timm.models import save_for_hf
    from transformers import AutoModelForImageClassification

    model, _ = saved
    save_for_hf(model, tmp_path, model_args=dcvit.model_args(model), safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["model_args"]["num_classes"] == len(CLASSES)
    with pytest.raises(TypeError, match="multiple values for keyword argument 'num_classes'"):
        AutoModelForImageClassification.from_pretrained(tmp_path)
