"""Every Python example in the documentation (docs/*.md) runs as written: on this host, and on
a described CPU without fast bfloat16 or float16 (AVX2 only), where a precision that is slow
must either be allowed in the example itself or be marked, with the page saying what to set.
Neither run sets the allow switch unless the block is marked.

A block is marked by an HTML comment on the line before its fence (invisible on the site):

- ``<!-- test: allow-slow -->``: the example uses a precision slow on some CPUs and the page
  names the switch (``MIXPREC_ALLOW_SLOW=1`` / ``allow_slow``): it runs with the switch set.
- ``<!-- test: skip, needs a CUDA GPU -->`` or ``<!-- test: skip, several processes -->``:
  the example cannot run in one CPU process; the CUDA and multi-process test files cover it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from devices import AVX2_CPU

import mixprec
from mixprec import hardware
from mixprec.hardware import ALLOW_SLOW_ENV

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(?:<!-- test: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
MARKS = {"allow-slow", "skip, needs a CUDA GPU", "skip, several processes"}
BLOCKS = [
    (page.name, i, m["mark"], m["code"])
    for page in sorted(DOCS.glob("*.md"))
    for i, m in enumerate(BLOCK.finditer(page.read_text()))
]
IDS = [f"{page}[{i}]" for page, i, _, _ in BLOCKS]


def test_the_docs_have_examples_and_only_known_marks():
    assert len(BLOCKS) >= 15
    assert {mark for _, _, mark, _ in BLOCKS} <= MARKS | {None}
    for page, i, mark, _ in BLOCKS:
        if mark == "allow-slow":
            text = (DOCS / page).read_text()
            assert ALLOW_SLOW_ENV in text or "allow_slow" in text, f"{page}[{i}]"


def _run(page: str, index: int, code: str) -> None:
    exec(compile(code, f"docs/{page}[python block {index}]", "exec"), {})


# on a host that already is AVX2-only (or capped to it, as CI's second run is) the host run
# is the AVX2 run: it runs once
FAST_FLAGS = {"avx512bw", "avx512_bf16", "amx_bf16", "avx512_fp16"}
CPUS = ["host", "avx2"] if hardware.detect("cpu").cpu_flags & FAST_FLAGS else ["host"]


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize(("page", "index", "mark", "code"), BLOCKS, ids=IDS)
def test_docs_example_runs(page, index, mark, code, cpu, tmp_path, monkeypatch):
    if mark is not None and mark.startswith("skip"):
        pytest.skip(mark.removeprefix("skip, "))
    monkeypatch.chdir(tmp_path)
    if mark == "allow-slow":
        monkeypatch.setenv(ALLOW_SLOW_ENV, "1")
    else:
        monkeypatch.delenv(ALLOW_SLOW_ENV, raising=False)
    if cpu == "host":
        _run(page, index, code)
    else:
        with hardware.assume(AVX2_CPU):
            _run(page, index, code)


SEED_TITLE = "First experiments with TensorFlow mixed-precision training"


def test_every_page_quoting_the_seed_blog_names_it():
    """ "The seed blog" means nothing to a newcomer: each page that quotes it gives its title
    (and says what it measured there)."""
    pages = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    quoting = [p for p in pages if re.search(r"seed (blog|experiment)", p.read_text())]
    assert quoting
    for page in quoting:
        text = " ".join(page.read_text().split())
        assert SEED_TITLE in text, page.name
        assert "Tesla V100" in text and "1.1x" in text, page.name


def test_no_page_points_at_a_table_above_that_is_not_there():
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"table above", text):
            assert "|---" in text[: m.start()], f"{page.name}: 'table above' with no table above"


def test_getting_started_shows_what_mixprec_prints_on_that_cpu(capsys, monkeypatch):
    """The page's `mixprec info` table and SlowPrecisionError are what mixprec prints for the
    CPU it names, an AVX2-only EPYC whose GEMMs measured 0.033x (bf16) and 0.037x (fp16)."""
    import torch

    from mixprec.cli import main
    from mixprec.hardware import DeviceInfo

    page = (DOCS / "getting-started.md").read_text()
    epyc = DeviceInfo(
        "cpu",
        "AMD EPYC",
        cpu_flags=frozenset({"avx2", "fma"}),
        gemm_ratios={"bfloat16": 0.033, "float16": 0.037},
    )
    monkeypatch.setenv("COLUMNS", "100")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with hardware.assume(epyc):
            assert main(["info", "--device", "cpu"]) == 0
            out = capsys.readouterr().out
            with pytest.raises(mixprec.SlowPrecisionError) as err:
                mixprec.Precision("bf16-mixed").setup(torch.nn.Linear(2, 2))
    finally:
        torch.set_num_threads(threads)
    rows = [line.rstrip() for line in out.splitlines() if line.startswith("│")]
    assert len(rows) >= 8
    for row in rows:
        assert row in page, row
    assert '"auto" resolves to: 32-true' in page and '"auto" resolves to: 32-true' in out
    # (and where each precision would be fast, as printed: the page once named Apple silicon
    # for bfloat16, which mixprec rates supported there)
    flat_page, flat_out = " ".join(page.split()), " ".join(out.split())
    for lead in ("bfloat16 would be fast on:", "float16 would be fast on:"):
        line = flat_out.split(lead, 1)[1].split(" float16 would be fast on:")[0]
        line = line.split(" several processes:")[0]
        assert lead + line in flat_page, lead + line
    shown = page.split("mixprec.errors.SlowPrecisionError: ", 1)[1].split("```", 1)[0]
    assert " ".join(shown.split()) == " ".join(str(err.value).split())
    order = ["## 1. `mixprec info`", "## 2. Your model in bf16-mixed", "## 3. When a precision"]
    assert [page.index(h) for h in order] == sorted(page.index(h) for h in order)


LINK = re.compile(r"\]\((?![a-z]+:|#)(?P<target>[^)\s]+)\)")


def test_every_relative_link_of_the_pages_leads_to_a_file_in_the_repository():
    """Read as Markdown files (in a clone, on a code host), the pages' links resolve: results
    are linked where the repository holds them (`../benchmarks/results/...`), and the site's
    build points those links at its own results pages."""
    dead = []
    for page in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        for m in LINK.finditer(page.read_text()):
            target = m["target"].split("#")[0]
            if target and not (page.parent / target).exists():
                dead.append(f"{page.name}: {m['target']}")
    assert not dead, "links to nothing:\n" + "\n".join(dead)
