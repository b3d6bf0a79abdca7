"""`mixprec.eager.uncompiled`: a function kept out of torch.compile, dynamo loaded at its
first call; and a process that imports mixprec without compiling loads no dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch

from mixprec.eager import uncompiled


def test_importing_mixprec_loads_no_dynamo() -> None:
    """Three classes decorated with ``torch.compiler.disable`` loaded dynamo at import
    (about a second of every fresh process: the bench's and the planner's measuring ones,
    ``mixprec info``, launched ranks)."""
    code = "import sys, mixprec; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]


def test_an_uncompiled_function_runs_eagerly_inside_a_compiled_one_from_its_first_call() -> None:
    """Called first inside a compiled function, as later: run eagerly (its Python side
    effects happen at every call, which a traced function would replay once), and the
    compiled caller's result is the eager one."""
    calls = []

    @uncompiled
    def noted(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return x * 2

    def step(x: torch.Tensor) -> torch.Tensor:
        return noted(x + 1) - 1

    compiled = torch.compile(step, backend="eager")
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(compiled(x), step(x))
    assert calls == [False] * 6
    assert noted.__name__ == "noted"
