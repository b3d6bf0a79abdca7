"""The doctor's verdict rules one by one, on reports built by hand: each named and documented,
tried in the documented order (the first finding wins), the blame on the innermost module,
and finding kinds whose values are the strings reports carry."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from mixprec.doctor import rules
from mixprec.doctor.rules import MODULE_RULES, judge
from mixprec.doctor.verdicts import AT_RISK, BROKEN, OK, FindingKind, ModuleReport, Origins


def report(name: str, **fields: Any) -> ModuleReport:
    """A healthy float16 module's report, with `fields` changed."""
    base: dict[str, Any] = dict(
        name=name,
        type="Linear",
        order=0,
        dtype="float16",
        calls=1,
        numel=64,
        amax=1.0,
        amin=0.01,
        overflow=0.0,
        underflow=0.0,
        flushed=0.0,
        nonfinite=0,
        rel_error=0.001,
        sqnr_db=60.0,
        input_amax=1.0,
        input_nonfinite=0,
        input_rel_error=0.001,
    )
    return ModuleReport(**{**base, **fields})


def judged(*reports: ModuleReport, origins: Origins | None = None, **kwargs: Any) -> dict:
    modules = {m.name: m for m in reports}
    judge(modules, origins or Origins(), 2.0**16, 2.0**16, torch.float16, **kwargs)
    return modules


def test_every_rule_is_named_documented_and_listed_in_the_order_it_runs():
    names = [rule.__name__ for rule in MODULE_RULES]
    assert len(set(names)) == len(names)
    assert all(rule.__doc__ and len(rule.__doc__.split()) > 10 for rule in MODULE_RULES)
    documented = re.findall(r"`(\w+)`", rules.__doc__ or "")
    assert [n for n in documented if n in names] == names


def test_the_first_rule_that_finds_something_decides():
    # an output beyond float16's max that also grows the error: the overflow is the finding
    both = report("0", amax=1e5, nonfinite=3, rel_error=0.6)
    m = judged(both, report(""), origins=Origins(forward={"0"}), loss_finite=False)["0"]
    assert (m.verdict, m.kind) == (BROKEN, FindingKind.RANGE)
    assert m.reason == "output reaches 1.0e5 > float16 max 65504 (3 values become inf/NaN)"
    near = judged(report("0", amax=20000.0, rel_error=0.3))["0"]
    assert (near.verdict, near.kind) == (AT_RISK, FindingKind.RANGE)
    assert near.reason == "output reaches 2.0e4, within 4x of float16 max 65504"


def test_a_block_containing_a_flagged_module_is_not_blamed():
    modules = judged(report(""), report("0", amax=20000.0), report("0.a", amax=20000.0))
    inner, block, root = modules["0.a"], modules["0"], modules[""]
    assert (inner.verdict, inner.origin) == (AT_RISK, False)
    assert (block.verdict, block.kind, block.reason) == (OK, FindingKind.NONE, "")
    assert block.note == "contains 0.a (at risk)"
    assert (root.verdict, root.note) == (OK, "")


def test_the_model_itself_is_not_blamed_for_error_its_layers_built_up():
    """Found by a review: the root's inputs are the batch, which holds no error, so error
    built up over its layers read as made in it ('inputs 0'), and recommend moved the whole
    model to float32; its last layer, with the same error from inputs of 0.078, was ok."""
    modules = judged(
        report("", rel_error=0.104, input_rel_error=0.0, sqnr_db=19.7),
        report("4", rel_error=0.104, input_rel_error=0.078, sqnr_db=19.7),
    )
    assert modules[""].verdict == modules["4"].verdict == OK
    assert rules.error_grows(modules[""], _facts()) is None
    # a block is still judged against its inputs
    block = report("1", rel_error=0.2, input_rel_error=0.001)
    assert rules.error_grows(block, _facts()).verdict == AT_RISK


def _facts() -> rules.RunFacts:
    return rules.RunFacts(
        origins=Origins(),
        loss_scale=1.0,
        recommended_scale=1.0,
        range_dtype=torch.float16,
        update=None,
        loss_dtype=torch.float32,
        finite=True,
        forward_broken=False,
    )


def test_a_reference_output_past_the_max_with_a_finite_target_output_says_so():
    """The reason of an output past the max said its inputs were inf/NaN from upstream
    already, beside a table showing finite inputs and no inf/NaN."""
    finite = judged(report("0", amax=3.4e38, input_amax=2.0))["0"]
    assert finite.verdict == AT_RISK
    assert finite.reason == (
        "output reaches 3.4e38 in the reference, past float16 max 65504, where its float16 "
        "output is finite: those values are not the reference's (saturated or replaced)"
    )
    upstream = judged(report("0", amax=1e5, nonfinite=3, input_nonfinite=3))["0"]
    assert "its inputs are inf/NaN from upstream already" in upstream.reason


def test_quantized_layers_losing_precision_are_the_quantizations_finding():
    m = judged(report("0", rel_error=0.6, quantized="int8_from_mixed_bfloat16"))["0"]
    assert (m.verdict, m.kind) == (BROKEN, FindingKind.QUANTIZATION)
    plain = judged(report("0", rel_error=0.6))["0"]
    assert (plain.verdict, plain.kind) == (BROKEN, FindingKind.PRECISION)
    assert plain.reason.endswith(": it carries little signal")


def test_a_loss_overflowing_outside_the_modules_is_the_roots_finding():
    modules = judged(report(""), report("0"), loss_finite=False)
    root = modules[""]
    assert (root.verdict, root.kind, root.origin) == (BROKEN, FindingKind.LOSS, True)
    assert root.reason.startswith("the loss is inf/NaN although every module's output is finite")


def test_a_finite_loss_underflowing_outside_the_modules_is_the_roots_finding():
    def root(**kwargs: Any) -> ModuleReport:
        return judged(report(""), report("0"), **kwargs)[""]

    # a float16 loss below its smallest subnormal reads 0
    gone = root(loss=0.0, reference_loss=1e-9, loss_dtype=torch.float16)
    assert (gone.verdict, gone.kind) == (BROKEN, FindingKind.LOSS)
    assert gone.reason.startswith(
        "the loss is 0 where the reference's is 1.0e-9, which float16 cannot hold (it rounds "
        "to 0 below 2.98e-08): the loss is computed in float16, outside the modules"
    )
    # a float32 loss of 0: what it read lost that (16-bit logits), the modules' findings say
    assert root(loss=0.0, reference_loss=1e-4).verdict == OK
    # a float16 loss of 0 that float16 could hold: the same
    assert root(loss=0.0, reference_loss=1e-7, loss_dtype=torch.float16).verdict == AT_RISK
    # a float16 loss among the subnormals keeps fewer digits
    few = root(loss=1.02e-6, reference_loss=1e-6, loss_dtype=torch.float16)
    assert (few.verdict, few.kind) == (AT_RISK, FindingKind.LOSS)
    assert "below float16's smallest normal 6.1e-05" in few.reason and "0.02" in few.reason
    # none: a normal float16 loss, a float32 or bfloat16 loss that small, a reference of 0
    assert root(loss=1e-4, reference_loss=1e-4, loss_dtype=torch.float16).verdict == OK
    assert root(loss=1.02e-6, reference_loss=1e-6).verdict == OK
    assert root(loss=1.02e-6, reference_loss=1e-6, loss_dtype=torch.bfloat16).verdict == OK
    assert root(loss=0.0, reference_loss=0.0, loss_dtype=torch.float16).verdict == OK
    # a broken module explains the run: the loss is not blamed besides
    modules = judged(report(""), report("0", rel_error=0.6), loss=0.0, reference_loss=1e-9)
    assert modules[""].verdict == OK and modules["0"].verdict == BROKEN


def test_finding_kinds_are_the_strings_reports_carry():
    assert [k.value for k in FindingKind] == [
        "",
        "range",
        "precision",
        "quantization",
        "scale",
        "loss",
    ]
    assert FindingKind.SCALE == "scale" and str(FindingKind.SCALE) == "scale"
    assert f"{FindingKind.RANGE}" == "range" and json.dumps(FindingKind.LOSS) == '"loss"'
    assert report("0").kind is FindingKind.NONE and not FindingKind.NONE


def test_a_loops_forward_overflow_says_which_call_overflowed():
    """Found by a diff review: `forward_overflow` took a looped module's numbers from the
    call that overflowed but did not say which, unlike the other per-call findings ("in
    call N of M", as docs/doctor.md says): "cell output reaches 1.2e5" of a 12-call loop
    whose first seven calls are finite."""
    calls = tuple(
        report(
            "cell",
            calls=1,
            call=i,
            amax=1.2e5 if i >= 7 else 1.0,
            nonfinite=10 if i >= 7 else 0,
            input_nonfinite=10 if i > 7 else 0,
        )
        for i in range(12)
    )
    looped = report("cell", calls=12, amax=1.2e5, nonfinite=50, input_nonfinite=40, per_call=calls)
    m = judged(looped, report(""), origins=Origins(forward={"cell"}), loss_finite=False)["cell"]
    assert (m.verdict, m.kind) == (BROKEN, FindingKind.RANGE)
    assert m.reason == (
        "in call 8 of 12, output reaches 1.2e5 > float16 max 65504 (10 values become inf/NaN)"
    )
    # a module called once says no call
    once = judged(report("0", amax=1e5, nonfinite=3), origins=Origins(forward={"0"}))["0"]
    assert once.reason.startswith("output reaches")
