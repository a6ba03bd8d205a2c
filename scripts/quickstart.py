"""The quick start: digits -> shards -> ViT and DCViT trained under torchrun -> report.

    python scripts/quickstart.py [--out runs/quickstart] [--nproc 2] [--seed 0] [KEY=VALUE ...]

Every step runs the project's own command-line entry points, exactly as a user would:
``scripts/prepare_digits.py`` (scikit-learn's 1,797 bundled 8x8 digits, offline, upscaled to
32x32 RGB with a fixed stratified split), ``scripts/make_wds_shards.py`` (WebDataset shards),
``torchrun -m train_imagenet`` (training + evaluation, one run per model, same recipe
``configs/quickstart.yaml``), ``dcvit-report`` (parameter/FLOP efficiency with the
measured top-1) and ``scripts/attention_maps.py`` (per-head weights before and after Compose
for one digit). Extra ``KEY=VALUE`` arguments override the training config of both runs.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("vit_tiny_patch16_224", "dcvit_tiny")  # the same architecture, with and without DCMHA


def run(cmd, **kwargs) -> None:
    print("\n$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, **kwargs)


def shards_ready(shard_dir: Path) -> bool:
    return all((shard_dir / f"{split}.json").is_file() for split in ("train", "val"))


def prepare_data(data_dir: Path) -> Path:
    images, shards = data_dir / "images", data_dir / "shards"
    run([sys.executable, "scripts/prepare_digits.py", images, "--size", "32"])
    if not shards_ready(shards):
        run([sys.executable, "scripts/make_wds_shards.py", "--src", images / "train", "--out", shards,
             "--split", "train", "--shard-size", "256", "--workers", "2"])
        run([sys.executable, "scripts/make_wds_shards.py", "--src", images / "val", "--out", shards,
             "--split", "val", "--shard-size", "256", "--workers", "2", "--verify"])
    return shards


def pattern(shard_dir: Path, split: str) -> str:
    meta = json.loads((shard_dir / f"{split}.json").read_text())
    return str(shard_dir / meta["pattern"])


def torchrun(model: str, shards: Path, run_dir: Path, nproc: int, seed: int, args) -> None:
    """`torchrun -m train_imagenet` on the quick start's recipe and the digits shards; `args`
    are further command-line arguments (overrides, --eval-only)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "train_imagenet", "--config", "configs/quickstart.yaml",
           f"model={model}", f"data.train={pattern(shards, 'train')}", f"data.val={pattern(shards, 'val')}",
           f"output_dir={run_dir}", f"seed={seed}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))}
    run(cmd, env=env)


def train(model: str, shards: Path, out: Path, nproc: int, seed: int, overrides) -> dict:
    run_dir = out / model
    torchrun(model, shards, run_dir, nproc, seed, overrides)
    result = json.loads((run_dir / "eval.json").read_text())
    result["path"] = str(run_dir / "eval.json")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "quickstart", help="run directory")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "digits", help="data directory")
    parser.add_argument("--nproc", type=int, default=2, help="processes per training run (torchrun)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="delete previous runs in --out first")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="training config overrides")
    args = parser.parse_args(argv)
    if args.fresh and args.out.exists():
        shutil.rmtree(args.out)
    start = time.time()
    shards = prepare_data(args.data)
    results = [train(m, shards, args.out, args.nproc, args.seed, args.overrides) for m in MODELS]
    report_dir = args.out / "report"
    run([sys.executable, "-m", "dcvit.report", "--results", *[r["path"] for r in results], "--out", report_dir])
    maps = args.out / "attention_maps.png"
    run([sys.executable, "scripts/attention_maps.py", "--checkpoint", args.out / MODELS[1], "--digit", "0",
         "--out", maps])
    print(f"\nQuick start finished in {time.time() - start:.0f} s on held-out digits "
          f"({results[0]['num_samples']} images):")
    for r in results:
        print(f"  {r['model']:<24} top-1 {r['top1']:6.2f} %   top-5 {r['top5']:6.2f} %   ({r['path']})")
    print(f"  report: {report_dir / 'report.md'}  (plot: {report_dir / 'report.png'})")
    print(f"  attention maps of {MODELS[1]} before/after Compose: {maps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
