#!/usr/bin/env python3
"""PEFT's DoRA with kerf's weight norm, in a few lines.

PEFT computes the DoRA norm ||W + s * B @ A|| by materializing B @ A (through
an identity matrix, for FSDP's sake) every forward. `use_kerf_for_dora()`
swaps DoraLinearLayer.forward for one that asks kerf for the scale
m / ||W + s * B @ A|| straight from the factors (kerf.autograd.dora_scale:
the norm detached as in PEFT, the gradient reaching m only) and keeps the
rest of PEFT's formula.

The script trains a tiny model a few steps with PEFT as is and with kerf,
prints both loss curves and checks that they match.

    KERF_BUILD_DIR=build python3 examples/python/peft_dora_kerf.py

Needs torch and peft (prints SKIPPED and exits 0 without them); runs on CUDA
when there is a GPU, else on kerf's CPU back end.
"""

import copy
import os
import sys

if os.environ.get("KERF_BUILD_DIR"):
    sys.path.insert(0, os.path.join(os.path.abspath(os.environ["KERF_BUILD_DIR"]), "python"))

try:
    import peft
    import torch
    import torch.nn.functional as F
    from peft.tuners.lora.dora import DoraLinearLayer
except ImportError as e:
    print(f"SKIPPED: this example needs torch and peft ({e})")
    sys.exit(0)

import kerf
import kerf.autograd

kerf_calls = 0


def use_kerf_for_dora():
    """Makes PEFT's DoRA linear layers take their norm from kerf; returns a function that undoes it."""
    peft_forward = DoraLinearLayer.forward

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name=None, **kwargs):
        W = base_layer.weight
        if getattr(self, "_kwargs", None) or self.fan_in_fan_out or W.ndim != 2 or kwargs or \
                type(W) not in (torch.Tensor, torch.nn.Parameter):  # lazy init, Conv1D, quantized: PEFT's way
            extra = {} if base_result is None else {"base_result": base_result}
            if adapter_name is not None:  # newer PEFT versions pass it
                extra["adapter_name"] = adapter_name
            return peft_forward(self, x, lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base_layer,
                                **extra, **kwargs)
        global kerf_calls
        kerf_calls += 1
        # The kerf part: m / ||W + s * B @ A||, never materializing B @ A.
        mag_norm_scale = kerf.autograd.dora_scale(W, lora_A.weight, lora_B.weight, self.weight, scaling).view(1, -1)
        # The rest is PEFT's DoraLinearLayer.forward.
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            if base_layer.bias is not None:
                base_result = base_result - base_layer.bias
        else:
            base_result = F.linear(x, W.to(x.dtype))
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling

    DoraLinearLayer.forward = forward

    def undo():
        DoraLinearLayer.forward = peft_forward

    return undo


def train(model, data, steps, device):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = data[step % len(data)]
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    if torch.cuda.is_available() and kerf.cuda_available():
        device = "cuda"
    elif kerf.cpu_available():
        device = "cpu"
    else:
        print("SKIPPED: neither a CUDA device nor kerf's CPU back end")
        return 0
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    config = peft.LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=["0", "2"], lora_dropout=0.0,
                             init_lora_weights=True)
    model = peft.get_peft_model(base, config).to(device)
    data = [(torch.randn(16, 64), torch.randn(16, 32)) for _ in range(4)]
    steps = 20

    with_peft = train(copy.deepcopy(model), data, steps, device)
    undo = use_kerf_for_dora()
    try:
        with_kerf = train(copy.deepcopy(model), data, steps, device)
    finally:
        undo()

    print(f"peft {peft.__version__}, torch {torch.__version__}, kerf {kerf.__version__}, on {device}")
    print("step   loss (PEFT)      loss (PEFT + kerf norm)   |diff|")
    worst = 0.0
    for i, (a, b) in enumerate(zip(with_peft, with_kerf)):
        diff = abs(a - b)
        worst = max(worst, diff / max(1.0, abs(a)))
        print(f"{i:4d}   {a:.8f}       {b:.8f}                {diff:.2e}")
    assert kerf_calls > 0, "the kerf forward never ran: PEFT's DoRA layer API changed?"
    assert worst < 1e-4, f"the loss curves differ by {worst:.2e} (relative)"
    print(f"the curves match (worst relative difference {worst:.1e}); kerf computed {kerf_calls} DoRA norms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
