"""What importing a module costs: the file formats and the trainer's plumbing load no model code,
while ``import dcvit`` still registers the models with timm."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_CODE = ("dcvit.attention", "dcvit.fused", "dcvit.matrices", "dcvit.kernels",
              "dcvit.weights", "dcvit.maps", "dcvit.accounting")


def loaded_after(statement: str) -> list:
    """The dcvit/train_imagenet modules loaded by ``statement`` in a fresh interpreter."""
    code = (f"import sys\n{statement}\nimport json\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('dcvit', 'train_imagenet'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_file_formats_and_trainer_plumbing_load_no_model_code():
    model_code = repr(MODEL_CODE)
    loaded = loaded_after(
        "import dcvit.io, dcvit.schema\n"
        f"early = [m for m in sys.modules if m.startswith({model_code})]\n"
        "assert not early, early\n"
        "import train_imagenet.config, train_imagenet.data, train_imagenet.checkpoint, train_imagenet.__main__")
    assert "dcvit.models" in loaded  # the registration `import dcvit` always does
    assert not [m for m in loaded if m.startswith(MODEL_CODE)], loaded


def test_import_dcvit_registers_the_models_and_resolves_names_on_use():
    loaded = loaded_after("import dcvit, timm\n"
                          "assert timm.is_model('dcvit_small') and 'DCMHA' in dir(dcvit)\n"
                          "assert dcvit.DCMHA.__module__ == 'dcvit.attention' and dcvit.fused.IMPLS\n"
                          "import dcvit.functional as functional\n"
                          "assert callable(dcvit.compose) and functional.compose is dcvit.compose\n"
                          "from dcvit import compose, load_weights\n"
                          "try:\n    dcvit.no_such_name\nexcept AttributeError as e:\n"
                          "    assert 'no_such_name' in str(e)\nelse:\n    raise SystemExit(1)")
    assert {"dcvit.attention", "dcvit.fused", "dcvit.weights"} <= set(loaded)


def test_public_names_are_the_readme_table_and_old_names_warn():
    import warnings
    import dcvit
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert all(f"`dcvit.{name}`" in readme for name in dcvit.__all__)
    for name in dcvit.__all__:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            getattr(dcvit, name)
    with pytest.raises(AttributeError, match="import dcvit.nope"):
        dcvit.nope
