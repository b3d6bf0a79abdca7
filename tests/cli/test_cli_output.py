"""What the CLI prints: it fits the width it is printed at (an 80-column terminal leaves
columns out and names them, never cuts a value), a file or a pipe gets everything, and each
note is said once."""

from __future__ import annotations

import io
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from devices import AVX2_CPU, ZEN4
from rich.console import Console

from mixprec import Policy, PolicyMap, hardware, textout
from mixprec.bench.report import Summary, conclusion, markdown, notes, rich_table, summarize
from mixprec.bench.runner import RunResult
from mixprec.bench.suite import BenchReport, Config, Row
from mixprec.cli import main
from mixprec.hardware import dtype_support, policy_support, support_matrix

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _committed(run: str) -> tuple[BenchReport, list[Summary]]:
    """A committed bench run, summarized again from its recorded step times."""
    data = json.loads((RESULTS / run / "results.json").read_text())
    rows = [Row(Config(**r["config"]), RunResult.from_dict(r["result"])) for r in data["results"]]
    report = BenchReport(data["metadata"], rows)
    return report, summarize(report)


def _render(renderable, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _fits(text: str, width: int) -> None:
    assert "…" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width


def test_bf16_mixed_is_fast_because_of_bfloat16_not_its_float32_islands():
    bf16 = dtype_support(torch.bfloat16, ZEN4).reason
    assert policy_support(Policy("bf16-mixed"), ZEN4).reason == f"bfloat16: {bf16}"
    assert support_matrix(ZEN4)["32-true"].reason == "float32: baseline"
    # a worse policy in a map still gives its reason
    f16 = dtype_support(torch.float16, ZEN4).reason
    mixed = PolicyMap("bf16-mixed", {"head": "16-mixed"})
    assert policy_support(mixed, ZEN4).reason == f"float16: {f16}"


def test_info_at_80_columns_cuts_nothing_and_says_why_bf16_mixed_is_fast(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with hardware.assume(ZEN4):
        assert main(["info"]) == 0
    out = capsys.readouterr().out
    _fits(out, 80)
    flat = " ".join(out.replace("│", " ").split())
    assert "bf16-mixed fast bfloat16: bfloat16 matrix instructions" in flat
    assert "float32: baseline" in flat  # the 32-true row only
    assert flat.count("float32: baseline") == 1
    # the jargon points to the glossary, and every term it names is defined there
    assert "explained in docs/glossary.md" in flat
    named = flat.split("words used here (", 1)[1].split(", ...)", 1)[0].split(", ")
    terms = (ROOT / "docs" / "glossary.md").read_text()
    assert len(named) >= 5 and all(term in terms for term in named), named


def test_infos_speed_against_float32_keeps_a_ratio_that_is_not_1_off_1_00x():
    """`info --measure` printed 0.996 and 1.004 both as "1.00x"; more decimals, as the
    bench's cells."""
    from mixprec.cli import _relative

    assert [_relative(r) for r in (0.996, 1.004, 1.0, 3.1, 0.0081)] == [
        "0.996x", "1.004x", "1.00x", "3.10x", "0.0081x (123x slower)",
    ]  # fmt: skip


def test_the_bench_table_at_80_columns_leaves_out_columns_and_names_them():
    report, summaries = _committed("bench_default_cpu")
    text = _render(rich_table(report, summaries), 80)
    _fits(text, 80)
    rows = [line for line in text.splitlines() if "bf16-mixed" in line]
    assert len(rows) == 3 and all("x" in row and "MiB" in row for row in rows)
    # the speedup: rows run one after another in separate processes share no rounds, so
    # the ratio of their medians, with no interval (was "5.27x (4.89-5.48)", step i of one
    # run over step i of the other read as a 95% interval)
    assert "│    32 │ bf16-mixed │          153.0 │ 5.28x (medians) │   102.7 MiB │" in text
    # (the overhead, with its interval, goes before the peak memory)
    left_out = "left out at this width: min-max, samples/s, raw torch ms/step, mixprec overhead"
    assert left_out in " ".join(text.split())
    wide = _render(rich_table(report, summaries), 400)
    assert "left out" not in wide and "raw torch ms/step" in wide and "182.6" in wide


FACTORY = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_projection_layer = nn.Linear(8, 8)

        def forward(self, x):
            return self.attention_projection_layer(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer_encoder_block_number_0 = Block()

        def forward(self, x):
            return self.transformer_encoder_block_number_0(x)

    def make():
        torch.manual_seed(0)
        return Net(), (torch.randn(4, 8), torch.randint(0, 8, (4,))), F.cross_entropy
    """
)
LONG = "transformer_encoder_block_number_0.attention_projection_layer"


@pytest.fixture
def long_names(tmp_path: Path) -> str:
    (tmp_path / "longnames.py").write_text(FACTORY)
    return f"{tmp_path / 'longnames.py'}:make"


def test_written_to_a_file_the_doctor_cuts_nothing(long_names, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    args = ["doctor", long_names, "--precision", "bf16-mixed", "--no-report", "--no-recommend"]
    with hardware.assume(ZEN4):
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "…" not in out and LONG in out and "left out" not in out


def test_at_80_columns_the_doctor_wraps_long_names_and_cuts_nothing(
    long_names, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "80")
    args = ["doctor", long_names, "--precision", "bf16-mixed", "--no-report", "--no-recommend"]
    with hardware.assume(ZEN4):
        assert main(args) == 0
    out = capsys.readouterr().out
    _fits(out, 80)
    # the module column, its cells joined back: the long name is whole, only wrapped
    column = "".join(line.split("│")[1].strip() for line in out.splitlines() if "│" in line)
    assert LONG in column


def test_a_console_for_a_file_or_pipe_is_wide_unless_columns_is_set(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert textout.console().width == textout.FILE_WIDTH  # pytest's capture is no terminal
    monkeypatch.setenv("COLUMNS", "80")
    assert textout.console().width == 80


def test_the_doctor_says_once_that_the_precision_is_slow(tmp_path, capsys):
    args = ["doctor", str(ROOT / "examples/doctor_demo.py:make"), "--no-report"]
    with hardware.assume(AVX2_CPU):
        assert main(args) == 1  # broken layers found; the recommendation runs two more times
    err = capsys.readouterr().err
    assert err.count("is slow on") == 1
    assert "precision '16-mixed' is slow on cpu (AVX2-only x86" in " ".join(err.split())


def test_doctor_reports_are_numbered_and_never_overwritten(
    long_names, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    factory = long_names
    for _ in range(2):
        assert main(["doctor", factory, "--precision", "32-true", "--no-recommend"]) == 0
    runs = sorted((tmp_path / "doctor-report").iterdir())
    assert len(runs) == 2 and all((run / "report.md").is_file() for run in runs)
    capsys.readouterr()
    again = ["doctor", factory, "--precision", "32-true", "--out", str(runs[0])]
    assert main(again) == 2
    assert "already holds report.md" in capsys.readouterr().err


def test_the_bench_closes_with_one_sentence_against_float32_and_the_seed_experiment():
    # (its rows ran one after another in separate processes: no verdict, and why; it read
    # "95% intervals within 4.0-5.5x from 10 unpaired runs")
    assert conclusion(*_committed("bench_default_cpu")) == (
        "No verdict on how fast bf16-mixed trains the cnn model against float32 here: the "
        "configurations ran one after another in separate processes (as the mixprec version "
        "of this run timed every configuration), so a neighbour's load between them moves "
        "the ratio, and no interval can hold it; the ratio of their median step times is "
        "4.21-5.28x (batch 8-32). For a verdict, rerun with this version, which times them "
        "side by side in paired rounds. It uses 29-45% less peak memory than float32 (memory "
        "does not depend on the load)."
    )
    assert conclusion(*_committed("bench_default_cpu_avx2")) == (
        "No mixed precision is fast on this machine, so float32 is the one to train in here "
        "(as said above); the seed experiment got 1.1x from mixed precision on its V100 GPU."
    )
    report, summaries = _committed("bench_default_cpu")
    assert "## In one sentence" in markdown(report, summaries)
    # (a gap recorded before it said what was timed: read from the rows; it raised KeyError)
    report, summaries = _committed("bench_default_cpu_avx2")
    assert "only 32-true was timed" in markdown(report, summaries)


def test_a_terminal_warned_of_a_busy_machine_is_not_warned_again_under_the_table():
    report, summaries = _committed("bench_default_cpu")
    cores = os.cpu_count() or 1
    report.metadata["load_average_before"] = [cores + 2.0, 0.0, 0.0]
    assert any("other work was using the CPUs" in n for n in notes(report, summaries))
    assert not any("other work" in n for n in notes(report, summaries, busy=False))


def test_runs_started_in_the_same_second_get_their_own_default_folders(tmp_path):
    """`mixprec bench` without --out wrote to ./mixprec-bench/<timestamp>: a second run
    started in the same second shared it and overwrote the first one's results. The default
    folder is made when a run starts, with -2, -3, ... when the stamp is taken; a thread race
    for the same stamp still gives each its own."""
    from concurrent.futures import ThreadPoolExecutor

    from mixprec.cli.outputs import new_output_dir

    first = new_output_dir(tmp_path / "mixprec-bench", "20261128-030000")
    second = new_output_dir(tmp_path / "mixprec-bench", "20261128-030000")
    assert (first.name, second.name) == ("20261128-030000", "20261128-030000-2")
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: new_output_dir(tmp_path / "race", "stamp"), range(8)))
    assert len(set(made)) == 8 and all(path.is_dir() for path in made)


def test_written_to_a_file_a_table_keeps_every_column_and_wraps_between_words():
    """Piped, a table is no wider than `FILE_WIDTH` when its words allow: prose cells wrap
    between words, every column stays, and a name longer than the room left is kept whole
    (the table grows instead), so it can still be searched for."""
    import io

    prose = " ".join(["the reason this precision is rated as it is here"] * 6)
    table = textout.FittedTable(
        "t", [textout.Column("precision", "left"), textout.Column("why", "left", keep=1)]
    )
    table.add_row(["bf16-mixed", prose])
    out = io.StringIO()
    textout.FileConsole(width=textout.FILE_WIDTH, file=out).print(table)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= textout.FILE_WIDTH and len(lines) > 6
    joined = " ".join(line.split("│")[2].strip() for line in lines if line.count("│") == 3)
    assert joined == prose  # every word of the cell, in order, none broken
    long = "x" * (textout.FILE_WIDTH + 20)
    table.add_row([long, "short"])
    out = io.StringIO()
    textout.FileConsole(width=textout.FILE_WIDTH, file=out).print(table)
    assert long in out.getvalue() and "left out" not in out.getvalue()


def test_user_text_with_brackets_is_printed_as_given_not_read_as_markup(
    tmp_path, capsys, monkeypatch
):
    """Found by a review: a policy file `exp[lr=1e-3]/policy.json` was printed as
    `exp/policy.json` (rich read `[lr=1e-3]` as markup) in the header, the progress lines,
    the table and the reproduce command, which then named another file. User text is
    printed as given everywhere."""
    monkeypatch.chdir(tmp_path)
    folder = Path("exp[lr=1e-3]")
    folder.mkdir()
    PolicyMap("32-true").save(folder / "policy.json")
    (tmp_path / "tinybench.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef make():\n    torch.manual_seed(0)\n"
        "    batch = lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,)))\n"
        "    return nn.Linear(4, 2), batch, nn.functional.cross_entropy\n"
    )
    name = str(folder / "policy.json")
    args = ["bench", "--model", "tinybench.py:make", "--batch-sizes", "2"]
    args += ["--precision", "32-true", name, "--steps", "2", "--warmup", "0", "--threads", "1"]
    with hardware.assume(ZEN4):  # (described: no matmul rates measured for the gap)
        assert main([*args, "--out", "o"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert name in next(line for line in lines if line.startswith("mixprec bench:"))
    assert any(line.startswith(f"[2/2] {name} @ 2: ok") for line in lines)
    assert any(f"│ {name} │" in line for line in lines), out  # the table row
    assert f"'{name}'" in next(line for line in lines if line.startswith("reproduce:"))
    assert "exp/policy.json" not in out


_TINY = (
    "import torch\nfrom torch import nn\n\n\ndef make():\n    torch.manual_seed(0)\n"
    "    batch = lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,)))\n"
    "    return nn.Linear(4, 2), batch, nn.functional.cross_entropy\n"
)


def test_user_text_with_emoji_codes_is_printed_as_given(tmp_path, capsys, monkeypatch):
    """Found by a review: rich read `:name:` in user text as an emoji code, so a policy file
    `run:100:a/policy.json` was printed `run💯a/policy.json` in the header, the progress
    lines, the table and the reproduce command (which then named another file)."""
    monkeypatch.chdir(tmp_path)
    folder = Path("run:100:a")
    folder.mkdir()
    PolicyMap("32-true").save(folder / "policy.json")
    (tmp_path / "tinybench.py").write_text(_TINY)
    name = str(folder / "policy.json")
    args = ["bench", "--model", "tinybench.py:make", "--batch-sizes", "2"]
    args += ["--precision", "32-true", name, "--steps", "2", "--warmup", "0", "--threads", "1"]
    with hardware.assume(ZEN4):  # (described: no matmul rates measured for the gap)
        assert main([*args, "--out", "o"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert name in next(line for line in lines if line.startswith("mixprec bench:"))
    assert any(line.startswith(f"[2/2] {name} @ 2: ok") for line in lines)
    assert "\N{HUNDRED POINTS SYMBOL}" not in out, out
    assert any(f"│ {name} │" in line for line in lines), out  # the table row
    assert f" {name} " in next(line for line in lines if line.startswith("reproduce:"))


def test_an_error_ending_in_a_backslash_is_printed_as_raised(tmp_path, capsys, monkeypatch):
    """Found by a review: an error message ending in a backslash was printed with two (rich's
    `escape` adds one, to keep a tag after it a tag, and none followed), and `:fire:` in it
    as an emoji. The error is printed as raised."""
    monkeypatch.chdir(tmp_path)
    message = "boom [bold]x[/] :fire: \\[q] end\\"
    (tmp_path / "bad.py").write_text(
        _TINY.replace("nn.functional.cross_entropy", "loss")
        + f"\n\ndef loss(out, target):\n    raise RuntimeError({message!r})\n"
    )
    args = ["bench", "--model", "bad.py:make", "--batch-sizes", "2", "--precision", "32-true"]
    args += ["--steps", "2", "--warmup", "0", "--threads", "1", "--out", "o"]
    with hardware.assume(ZEN4):
        assert main(args) == 1
    err = capsys.readouterr().err
    assert f"32-true @ 2: error RuntimeError: {message}\n" in err, err
