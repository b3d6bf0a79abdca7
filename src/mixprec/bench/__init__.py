"""`mixprec bench`: the seed blog's float32-vs-mixed experiment on the machine in hand.

Each configuration (precision x batch size) runs through `mixprec.Precision`; those of a
batch size take turns in rounds in this process (unless a fresh one would change their
figures), so that a speedup is a median of paired ratios with its interval (`verdict`);
mixed ones are also timed as a hand-written `torch.autocast` loop beside them, so the table
shows mixprec's overhead over raw torch. `Journal` writes each row to disk as it is
measured, and `load_journal` rebuilds the report from it.
"""

from mixprec.bench.journal import Journal
from mixprec.bench.journal import load as load_journal
from mixprec.bench.models import BlogCNN, Workload, load_workload
from mixprec.bench.report import Summary, summarize, write_outputs
from mixprec.bench.suite import BenchOptions, BenchReport, Listener, Plan, plan, run_bench

__all__ = [
    "BenchOptions",
    "BenchReport",
    "BlogCNN",
    "Journal",
    "Listener",
    "Plan",
    "Summary",
    "Workload",
    "load_journal",
    "load_workload",
    "plan",
    "run_bench",
    "summarize",
    "write_outputs",
]
