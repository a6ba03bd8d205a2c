"""Upcycling demonstration: the quick start's trained ViT on digits, fine-tuned as it is and
converted to DCMHA, with the same recipe.

    python scripts/upcycle_digits.py [--out runs/upcycle] [--epochs 10] [--nproc 2] [KEY=VALUE ...]

1. The quick start's ViT (``configs/quickstart.yaml``, ``vit_tiny_patch16_224`` at its small
   size) is trained on digits, as ``scripts/quickstart.py`` does (skipped when ``--out``
   already holds it); its weights are written as ``pretrained.safetensors``.
2. Both arms are evaluated at step 0 from that checkpoint: the ViT, and the ViT converted
   with ``convert.enabled=true`` (identity initialisation: the same function, so the same
   accuracy).
3. Both are fine-tuned for ``--epochs`` epochs from ``pretrained=pretrained.safetensors`` with
   the same recipe (the quick start's, lr and warm-up below); the converted arm's new
   parameters get ``convert.lr_mult`` and ``convert.weight_decay``.
4. ``upcycle.md`` in ``--out``: top-1 per epoch of both arms.

This shows the mechanism end to end on real (tiny) data; it is not evidence about DCMHA at
ImageNet scale. Extra ``KEY=VALUE`` arguments override the fine-tuning config of both arms.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quickstart  # noqa: E402  (the quick start's data preparation and torchrun command)

ROOT = quickstart.ROOT
MODEL = "vit_tiny_patch16_224"
# The fine-tuning recipe of both arms: the quick start's, at a quarter of its learning rate.
RECIPE = ["optim.lr=5e-4", "sched.warmup_epochs=1", "sched.warmup_lr=1e-5", "sched.min_lr=1e-5"]
CONVERT = ["convert.enabled=true", "convert.init=identity", "convert.lr_mult=10",
           "convert.weight_decay=0.0"]


def per_epoch(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "upcycle", help="run directory")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "digits", help="data directory")
    parser.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs of each arm")
    parser.add_argument("--pretrain-epochs", type=int, default=None,
                        help="epochs of the ViT's pretraining (default: the quick start's)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="fine-tuning config overrides")
    args = parser.parse_args(argv)
    start = time.time()
    shards = quickstart.prepare_data(args.data)

    pre_dir = args.out / MODEL
    if not (pre_dir / "eval.json").is_file():
        pre = [] if args.pretrain_epochs is None else [f"epochs={args.pretrain_epochs}", "sched.warmup_epochs=0"]
        quickstart.train(MODEL, shards, args.out, args.nproc, args.seed, pre)
    checkpoint = sorted(pre_dir.glob("ckpt-*.pth"))[-1]
    weights = args.out / "pretrained.safetensors"
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights))

    arms = {"ViT": [], "ViT -> DCMHA": CONVERT}
    rows = {}
    for name, extra in arms.items():
        tag = "dc" if extra else "vit"
        step0 = args.out / f"{tag}_step0"
        quickstart.torchrun(MODEL, shards, step0, args.nproc, args.seed,
                            ["--eval-only", f"checkpoint={checkpoint}", *extra])
        run_dir = args.out / f"{tag}_finetune"
        quickstart.torchrun(MODEL, shards, run_dir, args.nproc, args.seed,
                            [f"pretrained={weights}", f"epochs={args.epochs}", "resume=auto", *RECIPE,
                             *extra, *args.overrides])
        rows[name] = [json.loads((step0 / "eval.json").read_text())] + per_epoch(run_dir)

    n = json.loads((pre_dir / "eval.json").read_text())["num_samples"]
    lines = [f"Top-1 (%) on the {n} held-out digits; epoch 0 is the pretrained ViT before fine-tuning.", "",
             "| epoch | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for e in range(args.epochs + 1):
        lines.append(f"| {e} | " + " | ".join(f"{r[e]['top1']:.2f}" if e < len(r) and "top1" in r[e] else "-"
                                             for r in rows.values()) + " |")
    table = "\n".join(lines) + "\n"
    (args.out / "upcycle.md").write_text(table)
    print(f"\nUpcycling finished in {time.time() - start:.0f} s:\n\n{table}\n({args.out / 'upcycle.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
