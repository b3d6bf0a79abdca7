"""Every CUDA path of mixprec, run on a real GPU (the whole module is skipped without one).

Float16 loss scaling is checked bit for bit against `torch.amp.GradScaler` + `torch.autocast`
on the GPU (parameters, scale trajectory, skipped steps), including fused AdamW; pure float16
trains through float32 masters; TF32 really switches; the bench and the Trainer report device
memory from `torch.cuda.max_memory_allocated`; the Trainer's DDP runs on nccl; two processes
sharing one GPU over gloo skip together; the doctor blames the same layer on CUDA as on the
CPU.
"""

import copy
import json
import math
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from nets import overflow_model
from spawning import WORLD, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Trainer, apply
from mixprec.bench.runner import OK
from mixprec.cli import main
from mixprec.doctor import BROKEN, diagnose
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.precision import Precision

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda", 0)
F16, F32 = torch.float16, torch.float32


def _mlp(seed: int = 0, width: int = 64, out: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, out)
    ).to(CUDA)


def _torch_scaler_like() -> DynamicLossScaler:
    """Our dynamic scaler with torch.amp.GradScaler's settings (no bounds, short interval)."""
    return DynamicLossScaler(2.0**16, growth_interval=3, min_scale=0.0, max_scale=math.inf)


def _batches(steps: int, batch: int = 64, classes: int = 8, seed: int = 1):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(batch, 32, device=CUDA, generator=gen)
        yield x, torch.randint(0, classes, (batch,), device=CUDA, generator=gen)


# -- float16 loss scaling: bit for bit against torch's AMP on the GPU -------------------------


def test_16_mixed_matches_autocast_and_grad_scaler_bit_for_bit():
    """200 steps with planted inf/NaN gradients and inputs that overflow float16 in the
    forward: the same parameters, scale and skip decision after every step."""
    model = _mlp()
    ref_model = copy.deepcopy(model)
    precision = Precision("16-mixed", scaler=_torch_scaler_like())
    model, opt = precision.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-3)
    ref = torch.amp.GradScaler(CUDA.type, init_scale=2.0**16, growth_interval=3)

    skipped = 0
    for step, (x, y) in enumerate(_batches(200)):
        planted = {5: math.inf, 6: math.nan, 9: -math.inf}.get(step % 20)
        if step % 20 == 13:
            x = x * 1e6  # the first Linear's outputs pass 65504: inf in the float16 forward
        # the two lines of torch.amp: the loss inside the autocast the forward ran in (outside
        # it, CUDA's float32 log_softmax of float32 logits and autocast's of float16 ones
        # are two kernels that round differently)
        with precision.forward_context():
            loss = F.cross_entropy(model(x), y)
        precision.backward(loss)
        with torch.autocast(CUDA.type, dtype=F16):
            ref_loss = F.cross_entropy(ref_model(x), y)
        ref.scale(ref_loss).backward()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, equal_nan=True)
        if planted is not None:
            model[0].weight.grad[step % 7, 3] = planted
            ref_model[0].weight.grad[step % 7, 3] = planted
        before = ref.get_scale()
        stepped = precision.step(opt)
        ref.step(ref_opt)
        ref.update()
        assert stepped is (ref.get_scale() >= before), f"skip decision differs at step {step}"
        assert precision.scaler.loss_scale == ref.get_scale(), f"scale differs at step {step}"
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ at step {step}"
        if planted is not None or step % 20 == 13:
            assert not stepped, f"step {step} should have been skipped"
        skipped += not stepped
        opt.zero_grad()
        ref_opt.zero_grad()
    assert skipped >= 4 * 10
    assert precision.scaler.stats().skipped_steps == skipped
    taken = {int(s["step"]) for s in opt.state.values()}
    assert taken == {int(s["step"]) for s in ref_opt.state.values()} == {200 - skipped}


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_fused_adamw_skips_in_its_kernel_like_grad_scaler(explicit_unscale):
    """Fused AdamW gets `found_inf` and skips on device; identical to GradScaler driving the
    same fused optimizer (which unscales inside the kernel unless unscale_ came first)."""
    model = _mlp()
    ref_model = copy.deepcopy(model)
    precision = Precision("16-mixed", scaler=_torch_scaler_like())
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref = torch.amp.GradScaler(CUDA.type, init_scale=2.0**16, growth_interval=3)
    planted_steps = set()
    for step, (x, y) in enumerate(_batches(60)):
        with precision.forward_context():
            precision.backward(F.cross_entropy(model(x), y))
        with torch.autocast(CUDA.type, dtype=F16):
            ref_loss = F.cross_entropy(ref_model(x), y)
        ref.scale(ref_loss).backward()
        if step % 9 == 4:
            planted_steps.add(step)
            model[2].weight.grad[1, 1] = math.inf
            ref_model[2].weight.grad[1, 1] = math.inf
        if explicit_unscale:
            precision.unscale_()
            ref.unscale_(ref_opt)
        before = ref.get_scale()
        stepped = precision.step(opt)
        ref.step(ref_opt)
        ref.update()
        assert stepped is (ref.get_scale() >= before)
        if step in planted_steps:
            assert not stepped
        assert precision.scaler.loss_scale == ref.get_scale()
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ at step {step}"
        # fused AdamW takes back its step count on a skipped step
        for theirs, ours in zip(ref_opt.state.values(), opt.state.values(), strict=True):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours[key], theirs[key]), f"{key} differs at step {step}"
        opt.zero_grad()
        ref_opt.zero_grad()
    skipped = precision.scaler.stats().skipped_steps
    assert skipped >= len(planted_steps)
    assert {int(s["step"]) for s in opt.state.values()} == {60 - skipped}


def test_16_true_trains_through_float32_masters():
    """Pure float16 parameters, float32 masters in the optimizer; the loss falls tenfold and
    each float16 parameter is exactly its master rounded. torch's GradScaler refuses this."""
    model = _mlp(width=128, out=1)
    precision = Precision("16-true")
    model, opt = precision.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    gen = torch.Generator(device=CUDA).manual_seed(2)
    x = torch.randn(256, 32, device=CUDA, generator=gen)
    y = x[:, :4].sum(1, keepdim=True) + x[:, 4:5].abs()
    losses = []
    for _ in range(300):
        loss = F.mse_loss(model(precision.convert_input(x)).float(), y)
        precision.backward(loss)
        precision.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0] / 10
    assert all(p.dtype == F16 for p in model.parameters())
    masters = opt.master_params
    assert len(masters) == len(list(model.parameters()))
    for p in model.parameters():
        m = masters[p]
        assert m.dtype == F32 and m.device == p.device
        assert torch.equal(p, m.to(F16))
    assert all(q.dtype == F32 for g in opt.param_groups for q in g["params"])

    plain = _mlp(width=128, out=1).half()
    torch_opt = torch.optim.Adam(plain.parameters())
    scaler = torch.amp.GradScaler(CUDA.type)
    scaler.scale(F.mse_loss(plain(x.half()).float(), y)).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.step(torch_opt)


# -- TF32: the bench's switch really changes float32 matmuls and convolutions -----------------

_TF32_PROBE = textwrap.dedent(
    """
    import json, torch
    from mixprec.bench.runner import set_tf32

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1024, 1024, device="cuda", generator=g)
    b = torch.randn(1024, 1024, device="cuda", generator=g)
    x = torch.randn(8, 64, 32, 32, device="cuda", generator=g)
    w = torch.randn(64, 64, 3, 3, device="cuda", generator=g)
    exact_mm = (a.double() @ b.double())
    exact_conv = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    out = {}
    for mode in (False, True):
        set_tf32(mode)
        mm = ((a @ b).double() - exact_mm).norm() / exact_mm.norm()
        conv = torch.nn.functional.conv2d(x, w, padding=1).double()
        out[str(mode)] = [mm.item(), ((conv - exact_conv).norm() / exact_conv.norm()).item()]
    print(json.dumps(out))
    """
)


def test_tf32_switch_changes_float32_matmul_and_conv():
    """In a fresh process (TF32 is global state): off gives float32 accuracy (~1e-7), on
    gives TF32's 10-bit mantissa (~3e-4), for cuBLAS matmuls and cuDNN convolutions."""
    proc = subprocess.run(
        [sys.executable, "-c", _TF32_PROBE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for off, on in zip(errors["False"], errors["True"], strict=True):
        assert off < 5e-5  # float32 (cuDNN may pick a Winograd-type algorithm: ~1e-6)
        assert on > 1e-4 and on > 5 * off


# -- memory reported from the device ----------------------------------------------------------


def test_bench_on_cuda_reports_max_memory_allocated(tmp_path):
    out = tmp_path / "bench"
    args = ["--device", "cuda", "--image-size", "128", "--batch-sizes", "32", "--steps", "3"]
    args += ["--warmup", "1", "--precision", "32-true", "bf16-mixed", "16-mixed"]
    assert main(["bench", *args, "--tf32", "both", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "max_memory_allocated" in results["metadata"]["memory_method"]
    rows = {e["config"]["label"]: e["result"] for e in results["results"]}
    assert list(rows) == ["32-true (TF32 off)", "32-true (TF32 on)", "bf16-mixed", "16-mixed"]
    for label, r in rows.items():
        assert r["status"] == OK, (label, r["error"])
        ours = r["mixprec"]
        assert ours["peak_memory"] > 0 and len(ours["step_ms"]) == 3
        if label.endswith("-mixed"):
            raw = r["raw"]
            assert raw["status"] == OK and len(raw["step_ms"]) == 3
            # the same model, batch and optimizer under autocast: about the same memory
            assert 0.95 < ours["peak_memory"] / raw["peak_memory"] <= 1.05
    fp32 = rows["32-true (TF32 off)"]["mixprec"]["peak_memory"]
    assert rows["bf16-mixed"]["mixprec"]["peak_memory"] < fp32
    assert (out / "report.md").is_file() and (out / "results.csv").is_file()


def test_trainer_summary_reports_cuda_peak_memory(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 8))
    weight_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    data = TensorDataset(torch.randn(512, 1024), torch.randint(0, 8, (512,)))
    trainer = Trainer(
        precision="16-mixed",
        accelerator="cuda",
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    torch.cuda.reset_peak_memory_stats(CUDA)
    trainer.fit(model, DataLoader(data, batch_size=64), loss_fn=F.cross_entropy)
    assert next(model.parameters()).device.type == "cuda"
    summary = trainer.summary()
    peak_mib = torch.cuda.max_memory_allocated(CUDA) / 2**20
    # the step's tensors and their parts, then the whole fit's peak, as max_memory_allocated
    assert summary["peak memory"].endswith(
        f"; {peak_mib:,.0f} MiB allocated on the device over the fit"
    )
    assert "MiB of tensors at a step (weights " in summary["peak memory"]
    # float32 weights, their gradients and Adam's two moments all live during a step
    assert peak_mib >= 4 * weight_mib
    assert "loss scale" in summary and summary["epochs / steps"].endswith("/ 8")


# -- distributed ---------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_ddp_on_cuda_uses_nccl_one_process_per_gpu(tmp_path):
    """The Trainer's own DDP path on CUDA (nccl, spawned processes, one per visible GPU);
    the trained weights come back to the caller's model. Two processes on one GPU are
    refused with the reason: nccl needs a GPU per process."""
    gpus = torch.cuda.device_count()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    before = [p.detach().clone() for p in model.parameters()]
    data = TensorDataset(torch.randn(512, 32), torch.randint(0, 8, (512,)))
    flags = dict(
        precision="16-mixed",
        accelerator="cuda",
        strategy="ddp",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        seed=0,
    )
    trainer = Trainer(devices=gpus, **flags)
    trainer.fit(model, DataLoader(data, batch_size=16), loss_fn=F.cross_entropy)
    assert trainer.global_step == 6
    assert any(
        not torch.equal(a, b.detach().cpu())
        for a, b in zip(before, model.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="visible"):
        Trainer(devices=gpus + 1, **flags)


# -- two processes sharing one GPU over gloo --------------------------------------------------


def _ddp_worker(rank: int, out_dir: str) -> None:
    """One rank: DDP over gloo on CUDA tensors (one GPU is shared, which nccl refuses)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(CUDA)
    model = _mlp()
    start = [p.detach().clone() for p in model.parameters()]
    precision = Precision("16-mixed", scaler=DynamicLossScaler(2.0**10))
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = DistributedDataParallel(model, device_ids=[CUDA.index])
    taken, losses = [], []
    for step, (x, y) in enumerate(_batches(6, seed=10 + rank)):
        loss = F.cross_entropy(ddp(x), y)
        precision.backward(loss)
        if step == 2 and rank == 1:  # after DDP's all-reduce: only rank 1 sees it
            model[0].weight.grad[0, 0] = math.inf
        taken.append(precision.step(opt))
        opt.zero_grad()
        losses.append(loss.item())
    torch.save(
        {
            "taken": taken,
            "scale": precision.scaler.loss_scale,
            "params": [p.detach().cpu() for p in model.parameters()],
            "moved": any(
                not torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True)
            ),
            "device": str(next(model.parameters()).device),
        },
        f"{out_dir}/rank{rank}.pt",
    )


@pytest.mark.slow
def test_ddp_gloo_on_one_gpu_ranks_skip_together(tmp_path):
    """The Trainer's ddp strategy uses nccl and one GPU per process, so with one GPU this
    runs torch.distributed directly: gloo, 2 spawned processes, CUDA tensors, `Precision`."""
    run_ranks(_ddp_worker, str(tmp_path), nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    for r in (r0, r1):
        assert r["taken"] == [True, True, False, True, True, True]
        assert r["scale"] == 2.0**9
        assert r["moved"] and r["device"] == "cuda:0"
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


# -- the doctor: the same finding on CUDA as on the CPU ---------------------------------------


def test_doctor_blames_the_same_float16_layer_on_cuda_as_on_cpu():
    model, (x, y) = overflow_model(1e5)  # the doctor tests' planted fault: proj reaches 1e5
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 is slow on most CPUs: a warning only
        for device in ("cpu", "cuda"):
            d = diagnose(model, (x, y), F.cross_entropy, precision="16-mixed", device=device)
            assert d.device.type == device
            found[device] = d
    assert next(model.parameters()).device.type == "cpu"  # the model was not moved
    cpu, cuda = found["cpu"], found["cuda"]

    def summary(d):
        return [(m.name, m.verdict, m.kind, m.origin) for m in d.findings]

    assert summary(cuda) == summary(cpu)
    assert [m.name for m in cuda.findings if m.verdict == BROKEN] == ["proj"]
    for d in (cpu, cuda):
        assert d.modules["proj"].reason.startswith("output reaches 1.0e5 > float16 max 65504")
        assert d.modules["proj"].nonfinite > 0


class _Lengths(nn.Module):
    """Takes a CPU tensor (sequence lengths) before the CUDA input, as packed RNNs do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, lengths: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * lengths.to(x.device).float().mean()


def test_a_cpu_tensor_passed_first_does_not_turn_off_gpu_autocast():
    model = apply(_Lengths().cuda(), "bf16-mixed")
    seen = {}
    model.lin.register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    out = model(torch.tensor([3, 5]), torch.randn(4, 8, device="cuda"))
    assert seen["dtype"] == torch.bfloat16  # CUDA autocast ran, not CPU autocast
    assert out.dtype == torch.float32


def test_a_resumed_process_draws_on_its_own_gpu_where_the_saving_rank_did():
    # A DDP checkpoint comes from rank 0, whose list of per-GPU states holds the other ranks'
    # GPUs untouched; each rank resumes its own (current) GPU from the saving rank's instead.
    from mixprec.trainer.checkpoint import rng_states, set_rng_states

    torch.cuda.manual_seed_all(0)
    torch.rand(3, device=CUDA)
    saved = rng_states()
    expected = torch.rand(3, device=CUDA)
    torch.rand(100, device=CUDA)
    saved["cuda"] = [torch.cuda.get_rng_state(CUDA)]  # not the state this process drew from
    set_rng_states(saved)
    assert torch.equal(torch.rand(3, device=CUDA), expected)
