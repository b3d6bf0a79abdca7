"""A loss already multiplied by the loss scale is refused by every backward, also when it was
divided or weighted after the scaling (the accumulation idiom), and nothing else is."""

from unittest import mock

import pytest
import torch

import mixprec
from mixprec.optim.scaling import SCALED_SEARCH_DEPTH, DynamicLossScaler, is_scaled


def _set_up(spec: str = "16-mixed") -> tuple[mixprec.Precision, torch.nn.Module]:
    """A tiny model set up in `spec`; float16's scale is one its gradients can carry."""
    scaler = 1024.0 if spec == "16-mixed" else None
    precision = mixprec.Precision(spec, scaler=scaler, allow_slow=True)
    model = torch.nn.Linear(2, 1)
    model, _ = precision.setup(model, torch.optim.SGD(model.parameters()))
    return precision, model


@pytest.mark.parametrize(
    ("idiom", "derive"),
    [
        ("scaler.scale(loss) / 4", lambda scaled: scaled / 4),
        ("scaler.scale(loss) * 0.5", lambda scaled: scaled * 0.5),
    ],
)
def test_a_scaled_loss_divided_or_weighted_is_refused_naming_the_idiom_and_the_fix(idiom, derive):
    """``scaler.scale(loss) / accumulation_steps`` is a new tensor without the scaled mark;
    its backward would leave the gradients the scale times too large."""
    precision, model = _set_up()
    derived = derive(precision.scaler.scale(model(torch.ones(1, 2)).sum()))
    with pytest.raises(ValueError, match=r"scaler\.scale\(loss\) / accumulation_steps") as err:
        precision.backward(derived)
    assert "pass the loss itself, divided or weighted first (loss / accumulation_steps)" in str(
        err.value
    ), idiom
    assert model.weight.grad is None


def test_a_plain_loss_divided_for_accumulation_passes_and_is_scaled_once():
    precision, model = _set_up()
    precision.backward(model(torch.ones(1, 2)).sum() / 4)
    expected = torch.full((1, 2), 0.25 * precision.scaler.loss_scale)
    assert torch.equal(model.weight.grad, expected)


def test_a_sum_of_scaled_losses_and_a_few_operations_after_the_scaling_are_seen():
    scaler = DynamicLossScaler()
    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    assert not is_scaled(loss) and not is_scaled(loss / 4)
    assert is_scaled(scaler.scale(loss) + loss)
    assert is_scaled(sum(scaler.scale(loss * w) for w in (1.0, 2.0, 3.0)))
    deep = scaler.scale(loss)
    for _ in range(SCALED_SEARCH_DEPTH):
        deep = deep / 2
    assert is_scaled(deep)


def test_a_loss_whose_scaled_attribute_is_any_other_truthy_object_is_not_scaled():
    """Lightning's tests hand the backward a ``Mock``, whose every attribute is a truthy
    ``Mock``: only the mark ``scale`` sets marks a loss."""
    precision, model = _set_up()
    loss = model(torch.ones(1, 2)).sum()
    loss._mixprec_scaled = mock.Mock()
    assert not is_scaled(loss)
    precision.backward(loss)
    assert torch.equal(model.weight.grad, torch.full((1, 2), precision.scaler.loss_scale))

    stand_in = mock.Mock()
    bf16, _ = _set_up("bf16-mixed")
    bf16.backward(stand_in)
    stand_in.backward.assert_called_once_with()


def test_no_graph_is_walked_once_the_scaled_losses_are_gone():
    """`is_scaled` walks a loss's graph only while a tensor `scale` marked lives: a bfloat16
    step never pays for the search, nor a float16 step after the last one's scaled loss."""
    import gc

    from mixprec.optim import scaling

    gc.collect()
    precision, model = _set_up()
    precision.backward(model(torch.ones(1, 2)).sum())
    gc.collect()
    assert not scaling._live_marks
    scaled = precision.scaler.scale(model(torch.ones(1, 2)).sum())
    assert scaling._live_marks and is_scaled(scaled / 2)
    del scaled
    assert not scaling._live_marks
