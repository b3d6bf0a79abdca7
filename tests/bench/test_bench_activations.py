"""`mixprec bench --activations`: each precision run with each activation option beside keep,
recompute options on the model's blocks, the step time against keep's, the largest batch
against keep's, and the options refused before any process starts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.bench.models import activation_spec, find_blocks, load_workload
from mixprec.bench.report import max_batch_lines, summarize
from mixprec.bench.runner import OK, LoopResult, RunResult
from mixprec.bench.suite import BenchOptions, BenchReport, Config, Row, plan
from mixprec.cli import main
from mixprec.policy.map import PolicyMap

BLOCKS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(32)
            self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

        def forward(self, x):
            return x + self.mlp(self.ln(x))


    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), *(Block() for _ in range(3)), nn.Linear(32, 4))

        def make_batch(n):
            g = torch.Generator().manual_seed(0)
            return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

        return model, make_batch, nn.functional.cross_entropy
    """
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def test_blocks_are_the_entries_of_the_outermost_repeated_stacks():
    assert find_blocks(load_workload("transformer").model) == [
        "encoder.layers.0",
        "encoder.layers.1",
    ]
    assert find_blocks(load_workload("cnn", 16).model) == []  # layers of several kinds
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []  # leaf layers
    nested = nn.Module()
    nested.stack = nn.ModuleList([Block(), Block()])
    nested.head = nn.Linear(4, 2)
    assert find_blocks(nested) == ["stack.0", "stack.1"]
    assert find_blocks(nn.Sequential(Block(), Block(), Block())) == ["0", "1", "2"]
    gpt = nn.Sequential(nn.Embedding(8, 4), Block(), Block(), nn.Linear(4, 8))
    assert find_blocks(gpt) == ["1", "2"]


def test_recompute_options_go_on_each_block_the_others_on_the_whole_model():
    model = load_workload("transformer").model
    assert activation_spec(model, "fp8") == "fp8"
    assert activation_spec(model, "checkpoint") == {
        r"encoder\.layers\.0": "checkpoint",
        r"encoder\.layers\.1": "checkpoint",
    }
    with pytest.raises(ValueError, match="Sequential has none"):
        activation_spec(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "selective")


def test_plan_runs_every_precision_with_keep_and_each_option():
    p = plan(
        BenchOptions(
            model="transformer",
            precisions=["32-true", "bf16-mixed"],
            batch_sizes=[2],
            activations=["checkpoint", "fp8", "fp8"],
            allow_slow=True,
            device="cpu",
            threads=1,
        )
    )
    assert p.options.activations == ["keep", "checkpoint", "fp8"]
    assert [(c.label, c.activations, c.raw) for c in p.configs] == [
        ("32-true, activations keep", "keep", False),
        ("32-true, activations checkpoint per block", "checkpoint", False),
        ("32-true, activations fp8", "fp8", False),
        ("bf16-mixed, activations keep", "keep", True),  # the raw torch loop keeps all
        ("bf16-mixed, activations checkpoint per block", "checkpoint", False),
        ("bf16-mixed, activations fp8", "fp8", False),
    ]
    assert p.command.endswith("--activations keep checkpoint fp8")


@pytest.mark.parametrize(
    ("model", "options", "match"),
    [
        ("transformer", ["fp4"], "unknown activation option 'fp4'; expected 'keep', 'bf16'"),
        ("transformer", ["offload"], "'offload' .* CUDA only"),
        ("cnn", ["checkpoint"], "BlogCNN has none"),
    ],
)
def test_an_option_the_run_cannot_take_is_refused_before_it_starts(model, options, match):
    if "offload" in options and torch.cuda.is_available():
        pytest.skip("offload runs on this machine's CUDA device")
    opts = BenchOptions(model=model, activations=options, device="cpu", batch_sizes=[2])
    with pytest.raises(ValueError, match=match):
        plan(opts)


def test_a_block_that_cannot_be_recomputed_is_refused(tmp_path):
    (tmp_path / "bn.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def make():
                block = lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
                model = nn.Sequential(block(), block())
                return model, lambda n: (torch.randn(n, 4), torch.randint(0, 4, (n,))), (
                    nn.functional.cross_entropy
                )
            """
        )
    )
    opts = BenchOptions(
        model=f"{tmp_path / 'bn.py'}:make", activations=["selective"], batch_sizes=[2]
    )
    with pytest.raises(ValueError, match="--activations selective: module '0' .*running"):
        plan(opts)


def test_a_policy_file_with_activation_rules_of_its_own_is_refused(tmp_path):
    path = PolicyMap("bf16-mixed", activations="bf16").save(tmp_path / "p.json")
    opts = BenchOptions(
        model="transformer",
        precisions=[str(path)],
        activations=["fp8"],
        allow_slow=True,  # (the refusal is the same whether bf16 is fast on this CPU or not)
        device="cpu",
    )
    with pytest.raises(ValueError, match="has activations of its own \\('bf16'\\)"):
        plan(opts)


def test_activation_rows_run_side_by_side_with_their_step_time_against_keep(tmp_path):
    (tmp_path / "blocks.py").write_text(BLOCKS)
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            *("--model", f"{tmp_path / 'blocks.py'}:make", "--batch-sizes", "8"),
            *("--precision", "32-true", "--activations", "fp8", "checkpoint"),
            *("--steps", "3", "--warmup", "0", "--threads", "1", "--out", str(out)),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["metadata"]["activations"] == ["keep", "fp8", "checkpoint"]
    by = {e["config"]["activations"]: e for e in results["results"]}
    assert all(e["result"]["status"] == OK and e["result"]["paired"] for e in by.values())
    loss = {option: e["result"]["mixprec"]["final_loss"] for option, e in by.items()}
    assert loss["checkpoint"] == loss["keep"]  # recomputation is exact
    assert loss["fp8"] != loss["keep"]  # lossy storage: the options did go on the model
    summary = {e["summary"]["activations"]: e["summary"] for e in results["results"]}
    assert summary["keep"]["vs_keep"] == 1.0 and summary["keep"]["vs_keep_low"] is None
    fp8 = summary["fp8"]
    assert fp8["vs_keep_low"] <= fp8["vs_keep"] <= fp8["vs_keep_high"]
    md = (out / "report.md").read_text()
    assert "| step vs keep |" in md and "| 32-true, activations checkpoint per block |" in md
    assert "step vs keep: the median over rounds" in md


def _found(name: str, option: str, batch: int) -> dict:
    return {
        "max_batch": batch,
        "first_oom": batch + 1,
        "capped": False,
        "error": None,
        "probes": [],
        "precision": name,
        "activations": option,
    }


def test_the_largest_batch_of_an_option_is_told_against_keeps():
    report = BenchReport(
        {},
        [],
        {
            "bf16-mixed, activations keep": _found("bf16-mixed", "keep", 34),
            "bf16-mixed, activations fp8": _found("bf16-mixed", "fp8", 49),
            "bf16-mixed, activations checkpoint per block": _found("bf16-mixed", "checkpoint", 62),
        },
    )
    assert max_batch_lines(report) == [
        "bf16-mixed, activations keep: 34 fits, 35 runs out of memory",
        "bf16-mixed, activations fp8: 49 fits, 50 runs out of memory (1.44x keep's)",
        "bf16-mixed, activations checkpoint per block: 62 fits, 63 runs out of memory "
        "(1.82x keep's)",
    ]


def test_float32_with_an_activation_option_is_not_the_speedup_baseline():
    def row(option: str | None, ms: float) -> Row:
        label = "32-true" if option is None else f"32-true, activations {option}"
        config = Config(label, "32-true", 4, None, False, activations=option)
        return Row(config, RunResult(OK, LoopResult(step_ms=[ms] * 5), paired=True))

    fp8_first = BenchReport({}, [row("fp8", 20.0), row("keep", 10.0)])
    fp8, keep = summarize(fp8_first)
    assert keep.speedup == 1.0 and fp8.speedup == 0.5
    assert fp8.vs_keep == 2.0 and keep.vs_keep == 1.0
    (plain,) = summarize(BenchReport({}, [row(None, 10.0)]))
    assert plain.vs_keep is None and plain.activations is None


def test_strategy_runs_take_no_activations(capsys):
    code = main(["bench", "--strategy", "ddp", "--activations", "fp8"])
    assert code == 2
    assert "--activations is an option of the timing run" in capsys.readouterr().err


def test_the_reproduce_command_parses_back(tmp_path):
    p = plan(BenchOptions(model="transformer", activations=["bf16"], device="cpu", threads=1))
    from mixprec.cli import build_parser

    args = build_parser().parse_args(p.command.split()[1:])
    assert args.activations == ["keep", "bf16"]


def test_bench_results_of_before_activations_still_load(tmp_path):
    """A journal row written before the activations field (no key) reads back as None."""
    from dataclasses import asdict

    from mixprec.bench.journal import load

    config = asdict(Config("32-true", "32-true", 2, None, False))
    del config["activations"]
    result = asdict(RunResult(OK, LoopResult(step_ms=[1.0])))
    path = Path(tmp_path / "rows.jsonl")
    row = {"kind": "row", "config": config, "result": result, "elapsed_s": 1.0}
    path.write_text(
        json.dumps({"kind": "start", "metadata": {}, "planned": []}) + "\n" + json.dumps(row) + "\n"
    )
    report = load(path)
    assert report is not None and report.rows[0].config.activations is None
