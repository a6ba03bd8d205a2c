"""``dcvit-report``: the parameter-efficiency table of ViT and DCViT, measured here.

Each model is counted with `dcvit.accounting` (fvcore MACs, exact handles) and compared with
its baseline (``dcvit_X`` against ``vit_X`` built with the same non-DCMHA options). Accuracy
comes from the evaluation files the trainer writes (``eval.json``); the report never imports
the trainer. The paper's ImageNet numbers are listed apart, as quoted.

One module per job, in the order data flows:

* `model_spec` — which model is counted, with which options, against which baseline;
* `results` — reading ``eval.json``; `quoted` — the papers' numbers;
* `speed` — throughput on the model's device, paired with its baseline (`dcvit.bench.timing`);
* `measure` — the rows: accounting, accuracy and throughput columns, and how they were measured;
* `render` — ``report.md`` (a list of sections), ``.csv``, ``.json``; `plot` — ``report.png``;
* `cli` — the command line (``dcvit-report``, ``python -m dcvit.report``).
"""
from .cli import build_parser, main
from .measure import Report, param_efficiency_report
from .model_spec import DEFAULT_MODELS, ModelSpec, ReportError, check_model_name, parse_model_kwargs
from .plot import report_png
from .quoted import QUOTED
from .render import CSV_COLUMNS, MARKDOWN_SECTIONS, report_csv, report_markdown, write_report
from .results import read_results, results_spec
from .speed import measure_pair, measure_throughput

__all__ = ["ModelSpec", "param_efficiency_report", "write_report", "read_results",
           "measure_throughput", "measure_pair", "DEFAULT_MODELS", "QUOTED", "main",
           "Report", "ReportError", "check_model_name", "parse_model_kwargs", "results_spec",
           "report_csv", "report_markdown", "report_png", "build_parser", "CSV_COLUMNS",
           "MARKDOWN_SECTIONS"]
