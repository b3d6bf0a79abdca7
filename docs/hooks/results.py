"""MkDocs hook: the README and the committed benchmark results become pages of the site.

The README is the home page (its links into docs/ and benchmarks/results/ rewritten to the
site's). Every Markdown file, plot, JSON/CSV data file, log, text output and script under
benchmarks/results/ (and the GPU experiment's README) is added as a generated file under
results/, read from where it is committed, so the
site always shows what the repository holds and nothing is copied by hand. A results index
lists them. The pages link to results as the repository holds them (`../benchmarks/results/...`,
which a reader of the Markdown files can follow), and those links are pointed at the generated
pages as each page is read."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GPU_README = ROOT / "benchmarks" / "gpu" / "README.md"
README = ROOT / "README.md"


def home_page() -> str:
    """The README with its repository links turned into links between the site's pages."""
    text = README.read_text()
    text = text.replace("](benchmarks/results/)", "](results/index.md)")
    text = text.replace("](benchmarks/results/", "](results/")
    return re.sub(r"\]\(docs/", "](", text)


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", content=home_page()))
    entries = []
    for path in sorted(RESULTS.rglob("*")):
        # pages, plots, logs, the raw data files pages link to and scripts that made them
        if path.suffix not in {".md", ".png", ".json", ".csv", ".log", ".txt", ".py"}:
            continue
        uri = "results/" + path.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
        if path.suffix == ".md":
            entries.append((path.relative_to(RESULTS).as_posix(), _title(path)))
    files.append(File.generated(config, "results/gpu.md", abs_src_path=str(GPU_README)))
    entries.append(("gpu.md", "The GPU experiment (benchmarks/gpu)"))
    lines = [
        "# Results",
        "",
        "Every measurement quoted in these pages, as committed under `benchmarks/results/`",
        "(each file says how it was measured and the command that reproduces it):",
        "",
    ]
    lines += [f"- [{title}]({uri}) (`{uri}`)" for uri, title in entries]
    files.append(File.generated(config, "results/index.md", content="\n".join(lines) + "\n"))
    return files


def site_links(markdown: str) -> str:
    """A page's links into benchmarks/ (written for the repository) as links to the site's
    results pages."""
    markdown = markdown.replace("](../benchmarks/gpu/README.md)", "](results/gpu.md)")
    markdown = markdown.replace("](../benchmarks/results/)", "](results/index.md)")
    return markdown.replace("](../benchmarks/results/", "](results/")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri.startswith("results/"):
        # a results page links to the docs as the repository holds them (../../docs/x.md
        # from benchmarks/results/); on the site they sit one level up from results/
        depth = page.file.src_uri.count("/")
        return markdown.replace("](../../docs/", "](" + "../" * depth)
    return site_links(markdown)
