"""Inference with a Runtime: `Runtime.predict` and `Runtime.evaluate` call these.

Eval mode is torch's `module.eval()`: batch norm normalises with its running statistics and
dropout is off (the launchers read `rt.predicting`, ops.py), so each image's logits depend
on that image alone. A prediction walks the plan's forward steps up to the loss in the
training pool, then frees every activation it left, so training continues as before.
"""
from __future__ import annotations

import torch

from .inputs import check_images, check_labels


def predict(rt, images) -> torch.Tensor:
    """Logits for a batch of up to net.batch images (a CPU copy), in eval mode; a smaller
    batch is padded with zeros to the planned one."""
    net = rt.net
    n = check_images(net, images, up_to=True)
    if n < net.batch:
        pad = images.new_zeros((net.batch - n, *images.shape[1:]))
        images = torch.cat([images, pad])
    stop = rt.plan.loss_step
    rt.predicting = True
    try:
        rt._walk(images, None, until=stop)
        logits = rt.view(rt.program.act[rt.program.net.loss.inputs[0]])
        logits = logits[:n].detach().to("cpu", copy=True)
    finally:
        rt.predicting = False
        _free_activations(rt)
    return logits


def _free_activations(rt) -> None:
    """Wait for the copies of a cut-short iteration, then free every tensor that does not
    live across iterations (under "baseline" every tensor keeps its block: nothing to do)."""
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    if rt.policy == "baseline":
        return
    persistent = {t.id for t in rt.program.tensors if t.persistent}
    for t in rt.tensors:
        if t.id not in persistent and t.state not in ("unallocated", "freed"):
            t.free()


def evaluate(rt, loader) -> dict:
    """{"loss": mean cross-entropy, "accuracy": fraction correct} in eval mode over every
    sample of `loader`, an iterable of (images, labels) batches of any size (a torch
    DataLoader, say); batches larger than net.batch are predicted in parts."""
    import torch.nn.functional as F

    batch = rt.net.batch
    count, loss_sum, correct = 0, 0.0, 0
    for images, labels in loader:
        if not isinstance(images, torch.Tensor) or images.dim() == 0:
            raise ValueError(f"evaluate: images must be a batch tensor, got "
                             f"{type(images).__name__}")
        check_labels(rt.net, labels, len(images))
        for i in range(0, len(labels), batch):
            logits = predict(rt, images[i:i + batch]).double()
            y = labels[i:i + batch].cpu()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        count += len(labels)
    if count == 0:
        raise ValueError("evaluate: the loader gave no samples")
    return {"loss": loss_sum / count, "accuracy": correct / count}
