"""``--fsdp-master-dtype`` in one process: a bf16 model (``--diffusion-forward-dtype
bf16``) trains fp32 master weights with fp32 Adam state, checked against AdamW computed
by hand in float64 from the same gradients; checkpoints keep the masters; the EMA
follows them. The two-rank FSDP2 comparison with a real model is in test_fsdp.py."""

from __future__ import annotations

import pytest
import torch

from miles_core.config.resolve import resolve_config

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1"]
LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
OPTIMIZER = ("--lr", str(LR), "--adam-beta1", str(BETA1), "--adam-beta2", str(BETA2), "--adam-eps", str(EPS))
BF16 = ("--diffusion-forward-dtype", "bf16", "--weight-decay", str(WD), "--clip-grad", "0", *OPTIMIZER)
START = [[0.75, -1.0, 2.0, 0.625]]
"""Weights exactly representable in bf16, where half a bf16 step (2^-9 to 2^-8) exceeds an
Adam step at lr 1e-3: rounded to bf16, the first step's weights do not move."""


class _OneLayerFamily:
    """Just enough of a model family for the trainer: one bias-free linear layer, loaded
    in ``dtype`` (the forward dtype)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.transformer = torch.nn.Linear(4, 1, bias=False).to(dtype)
        with torch.no_grad():
            self.transformer.weight.copy_(torch.tensor(START))

    def components(self):
        return {"transformer": self.transformer}

    def trainable_parameters(self, component):
        return self.components()[component].named_parameters()


def _trainer(*flags: str, dtype: torch.dtype = torch.bfloat16):
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer

    config = resolve_config([*SD35, *flags])
    host = get_host()
    return Trainer(
        _OneLayerFamily(dtype), config, host.registries.sde_backend.get("sde").load(), host.registries.loss.get("policy_loss").load()
    )


INPUTS = [torch.tensor([[0.7, -0.2, 0.05, 1.5]]), torch.tensor([[-0.3, 0.9, 0.4, -0.6]])]


def _step(trainer, inputs=INPUTS) -> dict[str, float]:
    """One optimizer step over two micro-batches, each a bf16 forward and backward."""
    trainer.optimizer.zero_grad(set_to_none=True)
    layer = trainer.modules["transformer"]
    for x in inputs:
        (layer(x.to(layer.weight.dtype)).float().square().sum() * 0.5).backward()
    sums: dict[str, float] = {}
    trainer.finish_step(sums, skip=False)
    return sums


def _adamw_float64(start: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The first AdamW step by its formula, in float64: decoupled weight decay, then the
    bias-corrected moments (m = (1-b1) g, v = (1-b2) g^2 at step 1)."""
    p, g = start.double(), grad.double()
    m, v = (1 - BETA1) * g, (1 - BETA2) * g * g
    return p * (1 - LR * WD) - LR * (m / (1 - BETA1)) / ((v / (1 - BETA2)).sqrt() + EPS)


ATOL = 1e-6
"""fp32 masters of magnitude <= 2 against float64: AdamW's handful of fp32 operations
round to a few ulps (1.2e-7 relative); a bf16 weight near 2 is 2^-7 = 7.8e-3 coarse."""


@pytest.mark.exercises("--fsdp-master-dtype", "--diffusion-forward-dtype")
def test_one_process_trains_fp32_masters_of_a_bf16_model_by_the_adamw_formula():
    trainer = _trainer(*BF16)
    (param,) = trainer.parameters
    (master,) = trainer.masters.copies()
    assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert trainer.optimizer.param_groups[0]["params"] == [master]
    _step(trainer)
    # The backward's bf16 gradients were summed into the master's fp32 gradient, one per
    # micro-batch; none is left on the bf16 parameter.
    assert param.grad is None and master.grad.dtype == torch.float32
    # The same forward and backward on a plain bf16 copy of the layer (same kernels):
    # its per-micro-batch bf16 gradients, added in fp32.
    plain = _OneLayerFamily(torch.bfloat16).transformer
    grads = []
    for x in INPUTS:
        (plain(x.to(torch.bfloat16)).float().square().sum() * 0.5).backward()
        grads.append(plain.weight.grad.float())
        plain.weight.grad = None
    assert torch.equal(master.grad, grads[0] + grads[1])
    state = trainer.optimizer.state[master]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    expected = _adamw_float64(torch.tensor(START), master.grad)
    assert float((master.detach().double() - expected).abs().max()) <= ATOL
    assert float((master.detach().double() - torch.tensor(START).double()).abs().min()) > 5e-4  # every weight moved by ~lr
    # The model's bf16 weights are the masters rounded (here: not moved at all).
    assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))
    assert torch.equal(param.detach(), torch.tensor(START, dtype=torch.bfloat16))


def test_bf16_master_weights_fail_the_float64_comparison():
    """Control: with --fsdp-master-dtype bf16 the parameter is its own master (no copy)
    and Adam's steps are rounded away."""
    trainer = _trainer(*BF16, "--fsdp-master-dtype", "bf16")
    (param,) = trainer.parameters
    assert trainer.masters.copies() == [] and trainer.optimizer.param_groups[0]["params"] == [param]
    _step(trainer)
    assert trainer.optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
    expected = _adamw_float64(torch.tensor(START), param.grad)
    assert float((param.detach().double() - expected).abs().max()) > 100 * ATOL


def test_equal_dtypes_keep_no_copies():
    trainer = _trainer("--clip-grad", "0", *OPTIMIZER, dtype=torch.float32)  # fp32 forward on CPU, fp32 masters
    (param,) = trainer.parameters
    assert trainer.masters.copies() == [] and trainer.optimizer.param_groups[0]["params"] == [param]
    _step(trainer)
    assert param.grad is not None  # nothing moved it


@pytest.mark.exercises("--fsdp-master-dtype", "--use-ema")
def test_checkpoints_keep_the_masters_and_resume_exactly():
    trainer = _trainer(*BF16, "--use-ema", "--ema-rollout-policy", "ema")
    (master,) = trainer.masters.copies()
    _step(trainer)
    saved = {"weights": trainer.trainable_state(), "optimizer": trainer.optimizer_state(), "ema": trainer.ema.state_dict()}
    weights = saved["weights"]["transformer"]["weight"]
    assert weights.dtype == torch.float32 and torch.equal(weights, master.detach())
    # The EMA averages the masters (decay 0.001 at step 1), not their bf16 rounding,
    # which has not moved: d * start + (1 - d) * master.
    decay = trainer.ema.decay_at(1)
    shadow = saved["ema"]["shadow"]["transformer.weight"]
    assert torch.equal(shadow, torch.tensor(START).mul(decay).add(master.detach(), alpha=1 - decay))
    assert not torch.equal(shadow, torch.tensor(START))
    _step(trainer, INPUTS[::-1])

    resumed = _trainer(*BF16, "--use-ema", "--ema-rollout-policy", "ema")
    resumed.load_trainable_state(saved["weights"])
    resumed.load_optimizer_state(saved["optimizer"])
    resumed.ema.load_state_dict(saved["ema"])
    resumed.optimizer_steps = 1
    (param,) = resumed.parameters
    (copy,) = resumed.masters.copies()
    assert torch.equal(copy.detach(), weights) and torch.equal(param.detach(), weights.to(torch.bfloat16))
    _step(resumed, INPUTS[::-1])
    assert torch.equal(resumed.masters.copies()[0].detach(), trainer.masters.copies()[0].detach())
    assert torch.equal(resumed.ema.state_dict()["shadow"]["transformer.weight"], trainer.ema.state_dict()["shadow"]["transformer.weight"])

    # Control: resuming from the bf16 parameters instead of the masters loses the step.
    rounded = _trainer(*BF16, "--use-ema", "--ema-rollout-policy", "ema")
    rounded.load_trainable_state({"transformer": {"weight": weights.to(torch.bfloat16)}})
    assert not torch.equal(rounded.masters.copies()[0].detach(), weights)


def test_a_checkpoint_of_another_master_dtype_loads_cast():
    bf16 = _trainer(*BF16, "--fsdp-master-dtype", "bf16")
    _step(bf16)
    saved = {"weights": bf16.trainable_state(), "optimizer": bf16.optimizer_state()}
    assert saved["weights"]["transformer"]["weight"].dtype == torch.bfloat16
    fp32 = _trainer(*BF16)
    fp32.load_trainable_state(saved["weights"])
    fp32.load_optimizer_state(saved["optimizer"])
    (master,) = fp32.masters.copies()
    assert torch.equal(master.detach(), saved["weights"]["transformer"]["weight"].float())
    state = fp32.optimizer.state[master]
    assert state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"].float())
    _step(fp32)  # and it trains on
    assert fp32.optimizer.state[master]["exp_avg_sq"].dtype == torch.float32


@pytest.mark.exercises("--offload-train")
def test_offloading_a_bf16_trainer_takes_its_fp32_masters_off_and_back():
    from miles_core.training.offload import TrainerOffload, run_memory_report

    trainer, control = _trainer(*BF16), _trainer(*BF16)
    for each in (trainer, control):
        _step(each)
    (master,) = trainer.masters.copies()
    before = run_memory_report(trainer, None).by_role()
    # The fp32 master (16 bytes) is optimizer-side state with Adam's two moments and step;
    # its gradient (the bf16 parameter's own is dropped) is kept until the next step.
    assert before == {"parameters": 8, "gradients": 16, "optimizer_state": 16 + 2 * 16 + 4, "engine_weights": 0}
    off = TrainerOffload(trainer, keep_parameters=True)  # an in-process engine samples the bf16 weights
    off.offload()
    assert run_memory_report(trainer, None).by_role() == {"parameters": 8, "gradients": 0, "optimizer_state": 0, "engine_weights": 0}
    assert master.untyped_storage().nbytes() == 0
    off.reload()
    assert run_memory_report(trainer, None).by_role() == before
    # Training goes on exactly as a trainer that never offloaded.
    _step(trainer, INPUTS[::-1])
    _step(control, INPUTS[::-1])
    assert torch.equal(trainer.masters.copies()[0], control.masters.copies()[0])
    assert torch.equal(trainer.modules["transformer"].weight, control.modules["transformer"].weight)
