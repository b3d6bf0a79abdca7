"""`mixprec doctor` on a Hugging Face model: a tiny GPT-2 built from a config (random weights,
no download) whose second MLP has outlier activations, as trained language models often do.

Its `mlp.c_fc` in block 1 reaches 1e5, beyond float16's max 65504: harmless in float32 (a
LayerNorm follows the residual), NaN in float16. The doctor calls the model with the batch
(token ids with labels) as keyword arguments, takes the output's `.loss`, names the layer and
recommends a policy.

    python examples/doctor_gpt2.py
    mixprec doctor examples/doctor_gpt2.py:make --precision 16-mixed   # the same from the CLI
"""

from __future__ import annotations

import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from mixprec.doctor import diagnose

OUTLIER = 1e5  # peak of the planted activations, above float16's max 65504


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Two blocks of width 32 over a 64-token vocabulary, random weights, no dropout (the
    doctor compares two runs of the same network)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def make(batch_size: int = 4, length: int = 16, seed: int = 0) -> tuple[GPT2LMHeadModel, dict]:
    """The factory `mixprec doctor` calls: the model and a batch of token ids with labels."""
    model = tiny_gpt2(seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, length), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    fc = model.transformer.h[1].mlp.c_fc
    seen: list[torch.Tensor] = []
    hook = fc.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    with torch.no_grad():
        model(**batch)
    hook.remove()
    with torch.no_grad():  # the outliers: scale the layer so that its output peaks at OUTLIER
        factor = OUTLIER / seen[0].abs().max()
        fc.weight.mul_(factor)
        fc.bias.mul_(factor)
    return model, batch


def main() -> None:
    warnings.simplefilter("ignore")  # float16 is slow on most CPUs: fine for a diagnosis
    model, batch = make()
    diagnosis = diagnose(model, batch, precision="16-mixed")
    print(diagnosis)
    fix = diagnosis.recommend()
    print("recommended policy:\n" + fix.to_code())
    print("with it: " + fix.verified.summary().splitlines()[0])


if __name__ == "__main__":
    main()
