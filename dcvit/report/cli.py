"""``dcvit-report``: the parameter-efficiency table of ViT and DCViT, measured here.

::

    dcvit-report --models vit_small_patch16_224 dcvit_small_patch16_224 --out DIR
    dcvit-report --results runs/*/eval.json --throughput --detail --out DIR
    dcvit-report --models eva02_tiny_patch14_224 swin_tiny_patch4_window7_224 --convert rank=2 --out DIR

writes ``DIR/report.md``, ``report.csv``, ``report.json`` and ``report.png``.
"""
import argparse
import sys
from typing import Optional, Sequence

from ..io import unwritable_dir
from .measure import param_efficiency_report
from .model_spec import DEFAULT_MODELS, ModelSpec, ReportError, parse_model_kwargs
from .render import write_report
from .results import read_results

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcvit-report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help="timm model names (default: ViT and DCViT at Ti/S/M/B, unless --results is given)")
    p.add_argument("--results", nargs="+", default=[], metavar="FILE",
                   help="evaluation files (eval.json) to add measured accuracy; their model_kwargs/"
                        "img_size/num_classes set the configuration that is counted")
    p.add_argument("--out", default="report", metavar="DIR", help="output directory (default: ./report)")
    p.add_argument("--img-size", type=int, help="input resolution of every model (default: the model's)")
    p.add_argument("--model-kwargs", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra timm.create_model kwargs for every model, e.g. patch_size=4 num_classes=10")
    p.add_argument("--throughput", action="store_true", help="add measured img/s on this machine")
    p.add_argument("--throughput-batch", type=int, default=8, metavar="N", help="batch size for --throughput")
    p.add_argument("--throughput-steps", type=int, default=5, metavar="N",
                   help="timed forwards per model for --throughput (median; default 5)")
    p.add_argument("--convert", nargs="*", default=None, metavar="KEY=VALUE",
                   help="add each --models model converted to DCMHA (dcvit.convert with these options, "
                        "e.g. rank=2 layers=[0,1]) next to it")
    p.add_argument("--device", default="cpu", help="device --throughput runs on (default: cpu)")
    p.add_argument("--detail", action="store_true", help="add the per-module table of every model")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (problem := unwritable_dir(args.out)) is not None:  # before any counting
        parser.exit(2, f"dcvit-report: error: {problem}\n")
    try:
        base_kwargs = parse_model_kwargs(args.model_kwargs)
        if args.img_size is not None:
            base_kwargs["img_size"] = args.img_size
        results = [(path, read_results(path)) for path in args.results]
        names = args.models if args.models is not None else ([] if results else DEFAULT_MODELS)
        models = [ModelSpec.of(name, base_kwargs) for name in names]
        if args.convert is not None:
            convert = parse_model_kwargs(args.convert, "--convert")
            models = [s for m in models for s in (m, ModelSpec.of(m.name, base_kwargs, convert))]
        report = param_efficiency_report(models, results, base_kwargs, args.throughput,
                                         args.throughput_batch, args.detail,
                                         log=lambda m: print(m, file=sys.stderr),
                                         throughput_steps=args.throughput_steps, device=args.device)
    except ReportError as e:
        parser.exit(2, f"dcvit-report: error: {e}\n")
    command = "dcvit-report " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        paths = write_report(report, args.out, command)
    except ImportError as e:                          # matplotlib missing: name the extra
        parser.exit(2, f"dcvit-report: error: {e}\n")
    for r in report.rows:
        print(f"{str(ModelSpec.of(r['model'], r['model_kwargs'], r.get('convert'))):50s} params {r['params']:>12,} "
              f"({r['extra_params_pct']:+.2f} %)  MACs {r['macs']:>15,} ({r['extra_macs_pct']:+.2f} %)"
              + (f"  top-1 {r['top1']:.2f}" if "top1" in r else ""))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
