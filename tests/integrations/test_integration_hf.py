"""mixprec inside Hugging Face: the PrecisionMonitor as a `transformers.TrainerCallback`,
`MixprecTrainer` (loss scaling, skipped steps, clipping of true gradients), and the
Accelerate recipe, which must match a hand-written mixprec loop bit for bit."""

import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import mixprec
from mixprec import Precision
from mixprec.optim import scheduler_step

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from mixprec.integrations.huggingface import (  # noqa: E402
    MixprecTrainer,
    PrecisionMonitorCallback,
    SkipAwareScheduler,
    prepare,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from doctor_gpt2 import tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:precision .* is slow")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps one precision per process (HF's Trainer builds an Accelerator too):
    reset it around each test, as Accelerate's own test case does."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


LAYERS = [f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("attn.c_attn", "mlp.c_fc")]


def token_rows(n: int = 16, length: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def hf_args(tmp_path: Path, **kwargs) -> transformers.TrainingArguments:
    options = dict(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return transformers.TrainingArguments(**{**options, **kwargs})


class Overflow(transformers.TrainerCallback):
    """Makes one parameter's gradient inf at HF optimizer step `step`, and records the
    weights around that step."""

    def __init__(self, model: torch.nn.Module, step: int) -> None:
        self.param = model.transformer.h[0].mlp.c_fc.weight
        self.step = step
        self.handle = None
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.before = [p.detach().clone() for p in self.model.parameters()]
            self.handle = self.param.register_hook(lambda g: torch.full_like(g, math.inf))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            self.after = [p.detach().clone() for p in self.model.parameters()]


# -- the monitor callback ----------------------------------------------------------------------


def test_callback_in_a_plain_hf_trainer_writes_per_layer_amax(tmp_path):
    model = mixprec.apply(tiny_gpt2(), "bf16-mixed", warn=False)
    # HF keeps the batch keys the forward's signature names: the converted one shows them
    assert {"input_ids", "labels"} <= set(inspect.signature(model.forward).parameters)
    callback = PrecisionMonitorCallback(every_n_steps=2)
    trainer = transformers.Trainer(
        model=model,
        args=hf_args(tmp_path, max_steps=3),
        train_dataset=token_rows(),
        callbacks=[callback],
    )
    trainer.train()
    rows = [r for r in trainer.state.log_history if any(k.startswith("precision/") for k in r)]
    assert [r["step"] for r in rows] == [1, 3]  # HF steps 0 and 2, logged as HF numbers them
    for row in rows:
        for layer in LAYERS:
            assert 0 < row[f"precision/{layer}/amax"] < 100
            assert 0 < row[f"precision/{layer}/grad_amax"] < 100
        assert "precision/loss_scale" not in row  # HF's own optimizer: no mixprec scaler
    lines = (tmp_path / "precision_monitor.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    assert callback.warnings == []
    # no hook left behind: the converted model runs as before
    assert not any(m._forward_hooks for m in model.modules())


def test_callback_watches_hf_own_bf16_autocast(tmp_path):
    callback = PrecisionMonitorCallback(every_n_steps=1, path=False)
    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=hf_args(tmp_path, max_steps=1, bf16=True),
        train_dataset=token_rows(n=4),
        callbacks=[callback],
    )
    trainer.train()
    row = trainer.state.log_history[0]
    assert all(0 < row[f"precision/{layer}/amax"] < 100 for layer in LAYERS)


@pytest.mark.filterwarnings("ignore:layer .* gradients reaching it")  # no loss scaling here
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": 5}, "path is a file path .* got 5"),
        ({"path": True}, "path is a file path .* got True"),
        ({"monitor": "x"}, "monitor is a mixprec.PrecisionMonitor .* got str"),
        ({"trainer": object()}, "trainer is the transformers.Trainer .* got object"),
    ],
)
def test_callback_refuses_bad_arguments_when_built(kwargs, message):
    """path=5 and monitor="x" were accepted and failed inside train() with raw errors."""
    with pytest.raises(TypeError, match=message):
        PrecisionMonitorCallback(**kwargs)


def test_callback_says_when_hf_fp16_on_a_cpu_leaves_nothing_to_monitor(tmp_path):
    """Hugging Face's own fp16=True on a CPU trains in float32: the callback logged nothing
    and said nothing. It warns once, saying why."""
    callback = PrecisionMonitorCallback(every_n_steps=1, path=False)
    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=hf_args(tmp_path, max_steps=2, fp16=True),
        train_dataset=token_rows(n=8),
        callbacks=[callback],
    )
    with pytest.warns(UserWarning, match="step 0 ran no layer output in a 16- or 8-bit dtype.*"
                      "fp16=True does not lower a CPU run to float16") as caught:  # fmt: skip
        trainer.train()
    assert len([w for w in caught if "PrecisionMonitorCallback" in str(w.message)]) == 1


def test_callback_logs_through_trainer_log_and_warns_with_the_layer(tmp_path):
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(6e4)  # outputs near float16's max: 3e4
    model = mixprec.apply(model, "16-mixed", warn=False)
    logged: list[dict] = []

    class Seen(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs))

    trainer = transformers.Trainer(
        model=model,
        args=hf_args(tmp_path, max_steps=1, max_grad_norm=0.0),
        train_dataset=token_rows(),
        callbacks=[Seen()],
    )
    callback = PrecisionMonitorCallback(every_n_steps=1, trainer=trainer, path=False)
    trainer.add_callback(callback)
    with pytest.warns(mixprec.doctor.PrecisionWarning) as caught:
        trainer.train()
    near_max = [str(w.message) for w in caught if "within 4x of float16 max" in str(w.message)]
    assert near_max and near_max[0].startswith("layer transformer.h.1.mlp.c_fc reaches")
    monitored = [r for r in logged if "precision/transformer.h.1.mlp.c_fc/amax" in r]
    assert len(monitored) == 1 and "epoch" in monitored[0]  # a row of trainer.log
    history = [r for r in trainer.state.log_history if any(k.startswith("precision/") for k in r)]
    assert len(history) == 1  # logged once, not also appended by the callback
    assert not (tmp_path / "precision_monitor.jsonl").exists()


# -- MixprecTrainer ----------------------------------------------------------------------------


def test_mixprec_trainer_skips_an_overflow_and_holds_the_schedule(tmp_path):
    model = tiny_gpt2()
    overflow = Overflow(model, step=1)
    monitor = PrecisionMonitorCallback(every_n_steps=1, path=False)
    trainer = MixprecTrainer(
        model=model,
        args=hf_args(tmp_path, max_steps=4),
        train_dataset=token_rows(),
        precision=Precision("16-mixed", allow_slow=True),
        callbacks=[overflow, monitor],
    )
    trainer.train()
    optimizer = trainer.optimizer
    assert isinstance(optimizer, mixprec.LossScaleOptimizer)
    assert isinstance(trainer.lr_scheduler, SkipAwareScheduler)
    stats = optimizer.scaler.stats()
    assert stats.steps == 4 and stats.skipped_steps == 1 and stats.scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(overflow.before, overflow.after, strict=True))
    assert trainer.lr_scheduler.scheduler.last_epoch == 3  # 4 steps, one skipped
    lrs = [r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r]
    assert lrs[1] == lrs[2] and lrs[0] > lrs[1] > lrs[3]
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32  # mixed: fp32 weights
    # the monitor read the mixprec scaler through the optimizer
    scales = [
        r["precision/loss_scale"] for r in trainer.state.log_history if "precision/loss_scale" in r
    ]
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15]


def test_mixprec_trainer_clips_and_logs_unscaled_gradients(tmp_path):
    def grad_norms(precision: str) -> list[float]:
        args = hf_args(
            tmp_path / precision,
            max_steps=1,
            max_grad_norm=0.5,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,  # unscaled once, after the second micro-batch
        )
        trainer = MixprecTrainer(
            model=tiny_gpt2(),
            args=args,
            train_dataset=token_rows(),
            precision=Precision(precision, allow_slow=True),
        )
        trainer.train()
        assert trainer.precision.scaler.stats().steps == 1
        return [float(r["grad_norm"]) for r in trainer.state.log_history if "grad_norm" in r]

    reference, scaled = grad_norms("32-true"), grad_norms("16-mixed")
    # scaled by 65536 before unscaling: the logged norms would be 4.8 orders of magnitude off
    assert len(scaled) == 1 and scaled == pytest.approx(reference, rel=2e-2)
    assert reference[0] > 0.5  # the clip was active


def test_mixprec_trainer_with_a_given_optimizer_and_16_bit_weights(tmp_path):
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def trainer(max_grad_norm: float) -> MixprecTrainer:
        return MixprecTrainer(
            model=model,
            args=hf_args(tmp_path, max_steps=2, max_grad_norm=max_grad_norm),
            train_dataset=token_rows(),
            optimizers=(optimizer, scheduler),
            precision=Precision("16-true", allow_slow=True, scaler=1024.0),
        )

    before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    run = trainer(1e-3)  # (the masters were refused with max_grad_norm > 0: out of HF's reach)
    run.train()
    assert run.optimizer.optimizer is optimizer and len(run.optimizer.master_params) > 0
    weight = model.transformer.h[0].mlp.c_fc.weight
    assert weight.dtype == torch.float16 and not torch.equal(weight, before)
    assert scheduler.last_epoch == 2
    # HF's clip and logged norm are the masters' (HF logged 0 when it could not see them)
    norms = [r["grad_norm"] for r in run.state.log_history if "grad_norm" in r]
    assert len(norms) == 2 and all(n > 1e-3 for n in norms)
    masters = list(run.optimizer.master_params.values())
    assert sum(float(m.grad.norm()) ** 2 for m in masters) ** 0.5 == pytest.approx(1e-3, rel=1e-3)


def test_mixprec_trainer_refuses_to_clip_gradients_its_optimizer_leaves_scaled(tmp_path):
    """An optimizer given over part of the model while the rest still trains: HF clipped
    model.parameters(), whose other gradients no optimizer unscales (still multiplied by
    the loss scale), so the norm was 65536 times too large and the stepped parameters
    were clipped to nothing, silently. Now refused, naming them."""

    def trainer(max_grad_norm: float) -> MixprecTrainer:
        model = tiny_gpt2()
        optimizer = torch.optim.SGD(model.transformer.ln_f.parameters(), lr=0.1)
        return MixprecTrainer(
            model=model,
            args=hf_args(tmp_path, max_steps=1, max_grad_norm=max_grad_norm),
            train_dataset=token_rows(),
            optimizers=(optimizer, None),
            precision=Precision("16-mixed", allow_slow=True),
        )

    with pytest.raises(ValueError, match=r"transformer\.wte\.weight.*optimizer does not step"):
        trainer(1.0).train()
    # without clipping HF still measures the norm it logs: the optimizer's gradients'
    unclipped = trainer(0.0)
    unclipped.train()
    [norm] = [r["grad_norm"] for r in unclipped.state.log_history if "grad_norm" in r]
    assert 0 < norm < 100  # (the still-scaled gradients' norm was about 1e5)


def test_mixprec_trainer_resumes_an_hf_checkpoint_bit_for_bit(tmp_path):
    def run(directory: str, resume: str | None = None) -> MixprecTrainer:
        saving = dict(save_strategy="steps", save_steps=1) if resume is None else {}
        trainer = MixprecTrainer(
            model=tiny_gpt2(),
            args=hf_args(tmp_path / directory, max_steps=2, **saving),
            train_dataset=token_rows(n=12),
            precision=Precision("16-mixed", allow_slow=True),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    resumed = run("resumed", resume=str(tmp_path / "full" / "checkpoint-1"))
    pairs = zip(full.model.parameters(), resumed.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    # the scaler (scale, counters) came back with the optimizer's state
    assert resumed.precision.scaler.state_dict() == full.precision.scaler.state_dict()
    assert resumed.precision.scaler.stats().steps == 2


def tiny_llama(tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("spec", ["int8_from_float32", "int4/16_from_float32"])
def test_quantized_tied_embeddings_save_once_and_resume_bit_for_bit(tmp_path, spec, caplog):
    """The embedding and output head share one quantized copy: saving a checkpoint failed
    ("shared tensors ... not properly defined"), so no checkpoint and no resume."""
    from safetensors.torch import load_file

    def run(directory: str, resume: str | None = None) -> MixprecTrainer:
        saving = dict(save_strategy="steps", save_steps=2) if resume is None else {}
        trainer = MixprecTrainer(
            model=tiny_llama(),
            args=hf_args(tmp_path / directory, **saving),
            train_dataset=token_rows(length=16),
            precision=spec,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    head, embed = full.model.lm_head, full.model.model.embed_tokens
    assert head.qweight is embed.qweight and head.quantization_mode == spec[:4]
    saved = load_file(tmp_path / "full" / "checkpoint-2" / "model.safetensors")
    buffers = [k for k, _ in embed.named_buffers()]
    assert {k for k in saved if "embed_tokens" in k} == {f"model.embed_tokens.{k}" for k in buffers}
    assert not any(k.startswith("lm_head") for k in saved)  # the shared copy is saved once
    assert full.model._tied_weights_keys == {
        f"lm_head.{k}": f"model.embed_tokens.{k}" for k in buffers
    }
    with caplog.at_level("WARNING"):
        resumed = run("resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert "missing keys" not in caplog.text
    assert resumed.model.lm_head.qweight is resumed.model.model.embed_tokens.qweight
    final, again = full.model.state_dict(), resumed.model.state_dict()
    assert final.keys() == again.keys()
    assert all(torch.equal(final[k], again[k]) for k in final)
    resumed.model.tie_weights()  # ties the buffers, not the float weights quantization removed
    assert resumed.model.lm_head.qweight is resumed.model.model.embed_tokens.qweight


def test_untied_or_float_models_get_no_tie_entries(tmp_path):
    from mixprec.integrations.huggingface import tie_quantized_weights

    untied = MixprecTrainer(
        model=tiny_llama(tied=False), args=hf_args(tmp_path), precision="int8_from_float32"
    )
    assert untied.model.lm_head.qweight is not untied.model.model.embed_tokens.qweight
    assert tie_quantized_weights(untied.model) == {}
    assert untied.model._tied_weights_keys == {}  # (the declared tie of weights now gone)
    assert tie_quantized_weights(tiny_llama()) == {}  # float: its own mapping holds


@pytest.mark.parametrize("side", ["transformer.wte", "lm_head"])
def test_one_side_of_a_tie_quantized_leaves_a_model_that_ties_and_saves(tmp_path, side):
    """A tie whose source quantization replaced stayed in the mapping: tie_weights raised
    (GPT-2, one side quantized); and T5's two float embedding tables, still sharing the
    Parameter once the shared table is quantized, lost their tie, so save_pretrained
    raised on the undeclared shared tensor."""
    from mixprec.integrations.huggingface import tie_quantized_weights

    gpt2 = tiny_gpt2()
    with pytest.warns(UserWarning, match="unties them"):
        mixprec.apply(gpt2, mixprec.PolicyMap("32-true", {side: "int8_from_float32"}))
    assert tie_quantized_weights(gpt2) == {}
    gpt2.tie_weights()  # (raised AttributeError)
    gpt2.save_pretrained(tmp_path / "gpt2")

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            num_layers=1,
            num_decoder_layers=1,
            d_model=32,
            d_ff=64,
            d_kv=16,
            num_heads=2,
            vocab_size=64,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )  # fmt: skip
    ).eval()
    with pytest.warns(UserWarning, match="unties them"):
        mixprec.apply(t5, mixprec.PolicyMap("32-true", {r"shared|lm_head": "int8_from_float32"}))
    assert t5.encoder.embed_tokens.weight is t5.decoder.embed_tokens.weight
    tie_quantized_weights(t5)
    assert t5._tied_weights_keys["decoder.embed_tokens.weight"] == "encoder.embed_tokens.weight"
    t5.save_pretrained(tmp_path / "t5")  # (raised on the shared float tensor)
    t5.tie_weights()
    assert t5.encoder.embed_tokens.weight is t5.decoder.embed_tokens.weight


def test_tie_entries_take_the_list_form_of_transformers_4():
    """transformers 4 keeps the tied targets as a list and has no resolved mapping."""
    from mixprec.integrations.huggingface import tie_quantized_weights

    model = mixprec.apply(tiny_llama(), "int8_from_float32", warn=False)
    model._tied_weights_keys = ["lm_head.weight"]
    del model.all_tied_weights_keys
    added = tie_quantized_weights(model)
    assert added and all(k.startswith("lm_head.") for k in added)
    assert model._tied_weights_keys == list(added)  # the removed float weight is dropped
    assert "all_tied_weights_keys" not in model.__dict__


@pytest.mark.parametrize(
    ("flag", "spec"),
    [("bf16", "32-true"), ("bf16", "bf16-mixed"), ("fp16", "16-mixed")],
)
def test_mixprec_trainer_refuses_hf_mixed_precision_even_when_it_agrees(tmp_path, flag, spec):
    # HF's flag turns on its own autocast (and GradScaler for fp16): one place owns the
    # precision, so a flag that agrees with the policy is refused as well
    with pytest.raises(ValueError, match=rf"{flag}=True\).*even one that agrees.*fp16=False"):
        MixprecTrainer(
            model=tiny_gpt2(),
            args=hf_args(tmp_path, **{flag: True}),
            train_dataset=token_rows(),
            precision=Precision(spec, allow_slow=True),
        )


@pytest.mark.parametrize("value", ["bf16", "fp16"])
def test_mixprec_trainer_refuses_accelerates_precision_from_the_environment(
    tmp_path, monkeypatch, value
):
    # `accelerate launch --mixed_precision bf16` sets this; HF's Accelerator then autocast
    # the "32-true" run in bfloat16 with fp16=False, bf16=False in the arguments
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", value)
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=rf"mixed_precision='{value}'.*ACCELERATE_MIXED_PREC"):
        MixprecTrainer(
            model=model,
            args=hf_args(tmp_path),
            train_dataset=token_rows(),
            precision="32-true",
        )
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    trainer = MixprecTrainer(
        model=model, args=hf_args(tmp_path), train_dataset=token_rows(), precision="32-true"
    )
    assert trainer.accelerator.mixed_precision == "no"


@pytest.mark.parametrize(
    ("flag", "dtype"), [("bf16_full_eval", "bfloat16"), ("fp16_full_eval", "float16")]
)
def test_mixprec_trainer_refuses_hf_full_half_precision_evaluation(tmp_path, flag, dtype):
    # HF's evaluate() outside train() would cast the whole converted model (float32 islands
    # included) to 16 bits and leave it so; it crashed inside a float32 layer norm
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=rf"{flag}=True\) casts the whole model to {dtype}"):
        MixprecTrainer(
            model=model,
            args=hf_args(tmp_path, **{flag: True}),
            train_dataset=token_rows(),
            eval_dataset=token_rows(n=4),
            precision=Precision("bf16-mixed", allow_slow=True),
        )
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# -- Accelerate --------------------------------------------------------------------------------


def loader() -> DataLoader:
    return DataLoader(token_rows(n=12), batch_size=4, shuffle=False)


def inject(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    return model.transformer.h[0].mlp.c_fc.weight.register_hook(
        lambda g: torch.full_like(g, math.inf)
    )


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("clip", ["precision", "accelerator"])
def test_accelerate_recipe_matches_a_hand_written_loop_bit_for_bit(clip):
    """Either clipping call: ``accelerator.clip_grad_norm_`` clipped the scaled gradients
    (documented, not detected); for an accelerator given to `prepare` it unscales first."""
    # hand-written mixprec loop
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = schedule(optimizer)
    precision = Precision("16-mixed", allow_slow=True)
    model, optimizer = precision.setup(model, optimizer)
    for i, batch in enumerate(loader()):
        handle = inject(model) if i == 1 else None
        optimizer.zero_grad()
        precision.backward(model(**batch).loss)
        precision.clip_grad_norm_(model, 1.0)
        precision.step(optimizer)
        scheduler_step(scheduler, optimizer)
        if handle is not None:
            handle.remove()

    # the Accelerate recipe: set up once, the loop as Accelerate users write it
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    acc_model = tiny_gpt2()
    acc_optimizer = torch.optim.AdamW(acc_model.parameters(), lr=1e-3)
    acc_precision = Precision("16-mixed", allow_slow=True)
    acc_model, acc_optimizer, data, acc_scheduler = prepare(
        accelerator, acc_precision, acc_model, acc_optimizer, loader(), schedule(acc_optimizer)
    )
    for i, batch in enumerate(data):
        handle = inject(acc_model) if i == 1 else None
        acc_optimizer.zero_grad()
        loss = acc_model(**batch).loss
        accelerator.backward(loss)
        if clip == "precision":
            acc_precision.clip_grad_norm_(acc_model, 1.0)
        else:
            norm = accelerator.clip_grad_norm_(acc_model.parameters(), 1.0)
            assert i == 1 or norm < 100  # the unscaled norm, not 65536 times it
        acc_optimizer.step()
        acc_scheduler.step()
        if handle is not None:
            handle.remove()

    stats = acc_precision.scaler.stats()
    assert stats.steps == 3 and stats.skipped_steps == 1
    assert acc_scheduler.scheduler.last_epoch == scheduler.last_epoch == 2  # one step skipped
    assert acc_precision.scaler.state_dict() == precision.scaler.state_dict()
    for (name, a), b in zip(model.named_parameters(), acc_model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_accelerate_recipe_in_bf16_mixed_trains_like_the_hand_written_loop():
    def run(use_accelerate: bool) -> dict[str, torch.Tensor]:
        model = tiny_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        precision = Precision(
            mixprec.PolicyMap("bf16-mixed", {"lm_head": "32-true"}), allow_slow=True
        )
        if use_accelerate:
            accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
            model, optimizer, data = prepare(accelerator, precision, model, optimizer, loader())
        else:
            model, optimizer = precision.setup(model, optimizer)
            data = loader()
        for batch in data:
            optimizer.zero_grad()
            loss = model(**batch).loss
            if use_accelerate:
                accelerator.backward(loss)
            else:
                precision.backward(loss)
            optimizer.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    first = tiny_gpt2().state_dict()
    hand, recipe = run(False), run(True)
    assert hand.keys() == recipe.keys()
    assert all(torch.equal(hand[n], recipe[n]) for n in hand)
    assert not torch.equal(
        first["transformer.h.0.mlp.c_fc.weight"], recipe["transformer.h.0.mlp.c_fc.weight"]
    )


def test_prepare_refuses_accelerates_own_mixed_precision():
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*mixed_precision='no'"):
        prepare(accelerator, Precision("bf16-mixed", allow_slow=True), model, optimizer)
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32  # untouched


def test_prepare_names_the_environment_when_accelerate_took_its_precision_from_it(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    accelerator = accelerate.Accelerator(cpu=True)  # no mixed_precision=: the environment's
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*ACCELERATE_MIXED_PRECISION"):
        prepare(accelerator, Precision("32-true"), model, optimizer)


def test_accelerates_usual_accumulation_loop_steps_once_per_window():
    """Before: the wrapped optimizer stepped (and zeroed) on every micro-batch of
    `accelerator.accumulate`, where Accelerate's own waits for the window's last backward:
    the usual loop silently stepped twice as often as its scheduler, on half-window
    gradients. Now it matches the loop that checks `sync_gradients` itself, bit for bit."""

    def run(check: bool) -> dict[str, torch.Tensor]:
        accelerator = accelerate.Accelerator(
            mixed_precision="no", cpu=True, gradient_accumulation_steps=2
        )
        model = tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, data = prepare(
            accelerator, Precision("bf16-mixed", allow_slow=True), model, optimizer, loader()
        )
        steps = 0
        for batch in data:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if not check or accelerator.sync_gradients:
                    steps += bool(optimizer.step())
                    optimizer.zero_grad()
        assert steps == 2
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    usual, checked = run(False), run(True)
    assert all(torch.equal(usual[n], checked[n]) for n in usual)


@pytest.mark.parametrize("how", ["prepare before", "prepare after", "prepare_scheduler after"])
def test_a_scheduler_prepared_on_its_own_holds_on_a_skipped_step(how):
    """Found by a review: a scheduler given to Accelerate itself, before or after `prepare`
    (built once the loader's length is known), read no optimizer's skip (Accelerate knows
    no LossScaleOptimizer) and advanced on the overflow; it now follows the wrapper."""
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = schedule(optimizer)
    if how == "prepare before":
        scheduler = accelerator.prepare(scheduler)
    precision = Precision("16-mixed", allow_slow=True)
    model, wrapped, data = prepare(accelerator, precision, model, optimizer, loader())
    if how == "prepare after":
        scheduler = accelerator.prepare(scheduler)
    elif how == "prepare_scheduler after":
        scheduler = accelerator.prepare_scheduler(scheduler)
    assert scheduler.optimizers == [wrapped]
    for i, batch in enumerate(data):
        handle = inject(model) if i == 1 else None
        wrapped.zero_grad()
        accelerator.backward(model(**batch).loss)
        wrapped.step()
        scheduler.step()
        if handle is not None:
            handle.remove()
    assert precision.scaler.stats().skipped_steps == 1
    assert scheduler.scheduler.last_epoch == 2


def two_models() -> tuple[
    torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, torch.optim.Optimizer
]:
    a, b = tiny_gpt2(0), tiny_gpt2(1)
    return (
        a,
        torch.optim.SGD(a.parameters(), lr=0.1),
        b,
        torch.optim.SGD(b.parameters(), lr=0.1),
    )


def test_prepare_twice_with_one_precision_routes_the_backward_once():
    """Before: each `prepare` wrapped `accelerator.backward` again, so the first backward
    of a raw loss was refused as already multiplied by the loss scale."""
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    precision = Precision("16-mixed", allow_slow=True)
    a, opt_a, b, opt_b = two_models()
    a, opt_a, data = prepare(accelerator, precision, a, opt_a, loader())
    b, opt_b = prepare(accelerator, precision, b, opt_b)
    batch = next(iter(data))
    accelerator.backward(a(**batch).loss + b(**batch).loss)
    assert accelerator.clip_grad_norm_(b.parameters(), 1.0) < 100  # unscaled once
    assert precision.step(opt_a, opt_b)


def test_prepare_refuses_a_second_precision_on_one_accelerator():
    """Before: model B's loss was scaled by model A's scaler and never unscaled."""
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    a, opt_a, b, opt_b = two_models()
    prepare(accelerator, Precision("16-mixed", allow_slow=True), a, opt_a)
    with pytest.raises(ValueError, match="one Precision"):
        prepare(accelerator, Precision("bf16-mixed", allow_slow=True), b, opt_b)
    assert b.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32  # untouched


@pytest.mark.parametrize("extra", ["model", "optimizer"])
def test_prepare_refuses_a_model_or_optimizer_among_the_other_objects(extra):
    """Before: they went through `accelerator.prepare` unconverted, the optimizer stepping
    gradients still multiplied by the loss scale."""
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    a, opt_a, b, opt_b = two_models()
    objects = (b,) if extra == "model" else (opt_b,)
    name = "GPT2LMHeadModel" if extra == "model" else "SGD"
    with pytest.raises(ValueError, match=f"{name}.*prepare"):
        prepare(accelerator, Precision("16-mixed", allow_slow=True), a, opt_a, *objects)


@pytest.mark.parametrize("given", [False, True])
def test_accelerator_unscale_gradients_unscales_through_the_precision(given):
    """Before: a no-op, so a clip after it clipped gradients still multiplied by the scale."""
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    precision = Precision("16-mixed", allow_slow=True)
    model = tiny_gpt2()
    model, optimizer, data = prepare(
        accelerator, precision, model, torch.optim.SGD(model.parameters(), lr=0.1), loader()
    )
    accelerator.backward(model(**next(iter(data))).loss)
    accelerator.unscale_gradients(optimizer=optimizer if given else None)
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) < 100
    assert optimizer.step()


def test_accelerator_optimizer_step_was_skipped_reports_a_skipped_step():
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    model = tiny_gpt2()
    model, optimizer, data = prepare(
        accelerator,
        Precision("16-mixed", allow_slow=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader(),
    )
    batches = iter(data)
    handle = inject(model)
    accelerator.backward(model(**next(batches)).loss)
    assert not optimizer.step()
    assert accelerator.optimizer_step_was_skipped
    handle.remove()
    optimizer.zero_grad()
    accelerator.backward(model(**next(batches)).loss)
    assert optimizer.step()
    assert not accelerator.optimizer_step_was_skipped


def test_mixprec_trainer_leaves_a_greedy_lr_scheduler_unwrapped(tmp_path):
    """Before: wrapped in SkipAwareScheduler, HF's isinstance check missed it and stepped it
    without its metric (TypeError)."""
    from transformers.optimization import GreedyLR

    trainer = MixprecTrainer(
        model=tiny_gpt2(),
        args=hf_args(
            tmp_path,
            lr_scheduler_type="greedy",
            eval_strategy="steps",
            eval_steps=2,
            metric_for_best_model="loss",
        ),
        train_dataset=token_rows(),
        eval_dataset=token_rows(n=4, seed=1),
        precision="32-true",
    )
    trainer.train()
    assert isinstance(trainer.lr_scheduler, GreedyLR)


def test_mixprec_trainer_says_how_to_allow_a_slow_precision(tmp_path, monkeypatch):
    """Before: the hint named allow_slow_precision=True, which MixprecTrainer refuses."""
    monkeypatch.delenv("MIXPREC_ALLOW_SLOW", raising=False)
    try:
        Precision("16-mixed").resolve("cpu")
    except mixprec.errors.SlowPrecisionError:
        pass
    else:
        pytest.skip("float16 is not slow on this device")
    with pytest.raises(mixprec.errors.SlowPrecisionError) as caught:
        MixprecTrainer(
            model=tiny_gpt2(),
            args=hf_args(tmp_path),
            train_dataset=token_rows(),
            precision="16-mixed",
        )
    message = str(caught.value)
    assert "allow_slow_precision" not in message
    assert "Precision('16-mixed', allow_slow=True)" in message


def test_a_trained_model_prepared_past_mixprec_on_a_routed_accelerator_is_refused():
    """A second model (a critic) given to `accelerator.prepare` directly after `prepare`
    routed the accelerator's backward: its loss was multiplied by the loss scale and its
    AcceleratedOptimizer stepped gradients 65536 times too large, silently. A model with
    trainable parameters or an optimizer is now refused there; a frozen one goes through,
    and under a policy without loss scaling everything does."""
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    precision = Precision("16-mixed", allow_slow=True)
    a, opt_a, b, opt_b = two_models()
    prepare(accelerator, precision, a, opt_a)
    critic = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="Linear given to accelerator.prepare directly"):
        accelerator.prepare(critic)
    with pytest.raises(ValueError, match="SGD given to accelerator.prepare directly"):
        accelerator.prepare(torch.optim.SGD(critic.parameters(), lr=0.1))
    teacher = torch.nn.Linear(4, 1).requires_grad_(False)
    assert accelerator.prepare(teacher) is teacher
    b, _ = prepare(accelerator, precision, b, opt_b)  # a second mixprec model goes through
    assert accelerator.prepare(b) is b  # (and may be given again)
    # nor past Accelerate's other doors (a review found them open)
    with pytest.raises(ValueError, match="Linear given to accelerator.prepare directly"):
        accelerator.prepare_model(critic)
    with pytest.raises(ValueError, match="SGD given to accelerator.prepare directly"):
        accelerator.prepare_optimizer(torch.optim.SGD(critic.parameters(), lr=0.1))
    # and a model prepared before mixprec's prepare() is refused there
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    early = accelerate.Accelerator(mixed_precision="no", cpu=True)
    early.prepare(torch.nn.Linear(4, 1))
    a, opt_a, _, _ = two_models()
    with pytest.raises(ValueError, match="Linear given to accelerator.prepare directly, before"):
        prepare(early, Precision("16-mixed", allow_slow=True), a, opt_a)
    assert a.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32  # (nothing converted)

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    unscaled = accelerate.Accelerator(mixed_precision="no", cpu=True)
    a, opt_a, _, _ = two_models()
    prepare(unscaled, Precision("bf16-mixed", allow_slow=True), a, opt_a)
    assert unscaled.prepare(critic) is critic  # nothing scales its loss


def test_mixprec_trainer_refuses_to_resume_a_checkpoint_of_another_precision(tmp_path):
    """HF's resume took a bf16-mixed checkpoint into bf16-true silently (the optimizer
    state cast, the masters gone) and a 16-mixed one into bf16-mixed with a message about
    loss scaler kinds; the Lightning door names both precisions. So does this one now,
    before anything is loaded; the same precision resumes."""

    def trainer(root, precision: str, steps: int) -> MixprecTrainer:
        args = hf_args(root, max_steps=steps, save_strategy="steps", save_steps=2)
        return MixprecTrainer(
            model=tiny_gpt2(),
            args=args,
            train_dataset=token_rows(),
            precision=Precision(precision, allow_slow=True),
        )

    trainer(tmp_path / "a", "bf16-mixed", 2).train()
    saved = tmp_path / "a" / "checkpoint-2"
    assert json.loads((saved / "mixprec_precision.json").read_text())["policy"]
    other = trainer(tmp_path / "b", "bf16-true", 3)
    before = {n: p.detach().clone() for n, p in other.model.named_parameters()}
    with pytest.raises(ValueError, match=r"saved under PolicyMap\('bf16-mixed'.*bf16-true"):
        other.train(resume_from_checkpoint=str(saved))
    assert all(torch.equal(p, before[n]) for n, p in other.model.named_parameters())
    trainer(tmp_path / "c", "bf16-mixed", 3).train(resume_from_checkpoint=str(saved))


def test_mixprec_trainer_trains_and_evaluates_with_a_schedule_free_optimizer(tmp_path):
    """Found by a review: HF switches a schedule-free optimizer with ``optimizer.train()``
    and ``eval()`` where it has them, and the LossScaleOptimizer had none: the first step
    was refused. Now the run matches HF's own, bit for bit (a power-of-two static scale)."""
    pytest.importorskip("schedulefree")
    options = dict(optim="schedule_free_adamw", learning_rate=1e-2, max_steps=3)
    options.update(lr_scheduler_type="constant", eval_strategy="steps", eval_steps=3)
    losses, models = [], []
    for mixprec_trainer in (False, True):
        model = tiny_gpt2()
        kwargs = dict(model=model, train_dataset=token_rows(n=12))
        kwargs.update(args=hf_args(tmp_path, **options), eval_dataset=token_rows(n=4, seed=1))
        if mixprec_trainer:
            trainer = MixprecTrainer(**kwargs, precision=Precision("32-true", scaler=1024.0))
        else:
            trainer = transformers.Trainer(**kwargs)
        trainer.train()
        losses.append(trainer.evaluate()["eval_loss"])
        models.append(model)
    assert losses[0] == losses[1]
    ours, theirs = (list(m.parameters()) for m in models)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


# -- compiled models --------------------------------------------------------------------------


class Broken(torch.nn.Module):
    """A tiny model computing its own loss, with a graph break before its head: torch.compile
    resumes after it inside the model's region, its autocast on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.body(x).relu()
        torch._dynamo.graph_break()
        return {"loss": torch.nn.functional.mse_loss(self.head(hidden).float(), labels)}


def broken_rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, generator=g), "labels": torch.randn(4, generator=g)}] * 4


def head_rule() -> Precision:
    return Precision(mixprec.PolicyMap("bf16-mixed", {"head": "32-true"}), allow_slow=True)


class FirstGradients(transformers.TrainerCallback):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.grads: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = self.grads or [p.grad.clone() for p in self.model.parameters()]


def test_mixprec_trainer_backpropagates_a_compiled_models_float32_rule_as_eager(tmp_path):
    """Found by a review: after a graph break the compiled model ran on inside its region's
    bfloat16 autocast, and torch traced the backward there, so the float32 head's backward
    ran in bfloat16 (gradients ~1e-3 apart from eager's). HF's loss context now traces it
    outside autocast: bit for bit."""
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Broken()
        seen = FirstGradients(model)
        options = dict(max_steps=1, optim="sgd", max_grad_norm=0)
        if compiled:
            options.update(torch_compile=True, torch_compile_backend="aot_eager")
        MixprecTrainer(
            model=model,
            args=hf_args(tmp_path, **options),
            train_dataset=broken_rows(),
            precision=head_rule(),
            callbacks=[seen],
        ).train()
        grads.append(seen.grads)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_prepare_backpropagates_a_compiled_models_float32_rule_as_eager():
    """As for MixprecTrainer, with Accelerate's dynamo plugin: an Accelerate loop computes
    the loss outside any context, so the compiled model prepared here traces its backward
    outside autocast while its forward runs: bit for bit, and the setting is left as it
    was."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin
    from torch._functorch import config

    grads = []
    for plugin in (None, TorchDynamoPlugin(backend="aot_eager")):
        torch._dynamo.reset()
        AcceleratorState._reset_state(reset_partial_state=True)  # (it keeps the plugin)
        accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True, dynamo_plugin=plugin)
        model = Broken()
        prepared, _ = prepare(
            accelerator, head_rule(), model, torch.optim.SGD(model.parameters(), lr=0.1)
        )
        batch = broken_rows()[0]
        accelerator.backward(prepared(batch["x"][None], batch["labels"][None])["loss"])
        grads.append([p.grad for p in model.parameters()])
    assert isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert config.backward_pass_autocast == "same_as_forward"


class Logits(torch.nn.Module):
    """A tiny model handing back logits, its loss computed by the trainer's loss function."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.body(x)}


def test_a_custom_loss_sees_the_models_float32_outputs_outside_autocast(tmp_path):
    """Found by a review of a fix: HF's loss context had become the precision's autocast,
    so a custom loss (compute_loss_func) ran in bfloat16 on the outputs the model's region
    had left in bfloat16: the training loss moved. It runs as before, on float32 outputs."""
    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append((outputs["logits"].dtype, torch.is_autocast_enabled("cpu")))
        return torch.nn.functional.cross_entropy(outputs["logits"], labels)

    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 4)} for i in range(4)]
    MixprecTrainer(
        model=Logits(),
        args=hf_args(tmp_path, max_steps=1, remove_unused_columns=False),
        train_dataset=rows,
        precision=Precision("bf16-mixed", allow_slow=True),
        compute_loss_func=loss_func,
    ).train()
    assert seen == [(torch.float32, False)]
