"""Eval mode: rt.predict uses the running statistics (as module.eval()) for any batch up to
the planned one; rt.evaluate gives loss and accuracy over a DataLoader."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tinysn as sn
from tinysn.testing import every_layer_net


def _data(net, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((n, *net.input_shape), generator=gen),
            torch.randint(0, net.classes, (n,), generator=gen))


def _trained(device):
    """every_layer_net (bn, dropout p=0.4, fan, joins) after two steps, so the running
    statistics are neither the initial ones nor the batch's; and its torch eval model."""
    net = every_layer_net(batch=4, p=0.4)
    rt = sn.Runtime(net, "64MiB", "recompute", device=device, lr=0.1, momentum=0.9,
                    precision="ieee")
    for seed in (1, 2):
        rt.step(*(t.to(device) for t in _data(net, net.batch, seed)))
    ref = net.to_torch(params=rt.params()).double().eval()
    return net, rt, ref


@pytest.fixture(scope="module")
def trained():
    return _trained("cpu")


@pytest.mark.parametrize("n", [4, 3, 1])
def test_predict_matches_torch_eval_mode_for_any_batch_up_to_the_planned(trained, n):
    net, rt, ref = trained
    images, _ = _data(net, n, seed=10 + n)
    before, in_use = rt.params(), rt.arena.allocator.in_use
    logits = rt.predict(images)
    with torch.no_grad():
        want = ref(images.double())
    assert logits.shape == (n, net.classes)
    torch.testing.assert_close(logits.double(), want, rtol=1e-4, atol=1e-5)
    after = rt.params()                  # running statistics untouched, pool as it was
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert rt.arena.allocator.in_use == in_use


@pytest.mark.gpu
def test_predict_on_the_gpu_matches_torch_eval_mode():
    net, rt, ref = _trained("cuda")
    images, _ = _data(net, 3, seed=13)
    with torch.no_grad():
        want = ref(images.double())
    torch.testing.assert_close(rt.predict(images.cuda()).double(), want, rtol=1e-4, atol=1e-5)


def test_predict_is_per_image(trained):
    """Eval mode: an image's logits do not depend on the rest of the batch."""
    net, rt, _ = trained
    images, _ = _data(net, net.batch, seed=20)
    whole = rt.predict(images)
    torch.testing.assert_close(rt.predict(images[2:3]), whole[2:3], rtol=1e-5, atol=1e-6)


def test_predict_rejects_bad_batches(trained):
    net, rt, _ = trained
    images, _ = _data(net, net.batch + 1, seed=3)
    for bad in (images, images[:0], images[:, :2], images[0]):
        with pytest.raises(ValueError, match=r"images must have shape \(1\.\.4, 3, 9, 9\)"):
            rt.predict(bad)


def test_evaluate_over_a_dataloader_matches_torch(trained):
    """Batches of 3 (below the planned 4, with a tail of 1) and of 10 (split in parts)."""
    net, rt, ref = trained
    images, labels = _data(net, 10, seed=30)
    with torch.no_grad():
        logits = ref(images.double())
    want_loss = float(F.cross_entropy(logits, labels))
    want_acc = float((logits.argmax(1) == labels).double().mean())
    for size in (3, 10):
        got = rt.evaluate(DataLoader(TensorDataset(images, labels), batch_size=size))
        assert got["loss"] == pytest.approx(want_loss, rel=1e-4)
        assert got["accuracy"] == pytest.approx(want_acc)


def test_evaluate_rejects_bad_loaders(trained):
    net, rt, _ = trained
    images, labels = _data(net, 4, seed=40)
    with pytest.raises(ValueError, match="no samples"):
        rt.evaluate([])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        rt.evaluate([(images, labels + net.classes)])
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\)"):
        rt.evaluate([(images, labels[:3])])


def test_digits_command_reports_held_out_accuracy_and_loss(capsys):
    from tinysn import cli
    assert cli.main(["train", "--model", "lenet", "--data", "digits", "--device", "cpu",
                     "--steps", "1", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "on 359 digits" in out
    loss = float(out.split("held-out accuracy ")[1].split("loss ")[1].split()[0])
    assert 0 < loss < 10
