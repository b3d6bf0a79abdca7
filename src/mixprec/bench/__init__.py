"""`mixprec bench`: the seed blog's float32-vs-mixed experiment on the machine in hand.

Each configuration (precision x batch size) runs in a fresh process through
`mixprec.Precision`; mixed ones are also timed as a hand-written `torch.autocast` loop in
the same process, so the table shows mixprec's overhead over raw torch.
"""

from mixprec.bench.models import BlogCNN, Workload, load_workload
from mixprec.bench.report import Summary, summarize, write_outputs
from mixprec.bench.suite import BenchOptions, BenchReport, Plan, plan, run_bench

__all__ = [
    "BenchOptions",
    "BenchReport",
    "BlogCNN",
    "Plan",
    "Summary",
    "Workload",
    "load_workload",
    "plan",
    "run_bench",
    "summarize",
    "write_outputs",
]
