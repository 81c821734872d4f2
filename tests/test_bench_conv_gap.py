"""bench/conv_gap.py: each timed call runs the variant it is named for (the timing needs a GPU;
the calls run on the CPU through the interpreter)."""
import pytest
import torch

from bench import conv_gap


def test_each_variant_computes_what_its_name_says():
    """On a 12x12 conv with 8 channels: the forward's bias+relu is relu(plain + bias), the
    masked data gradient is the plain one zeroed where the ReLU output is <= 0, and the weight
    gradient writes dW and the bias gradient."""
    t = conv_gap._tensors(8, 12, 2, torch.Generator().manual_seed(0))
    calls = conv_gap._calls(t)
    assert {(p, v) for p, _, v in calls} == {
        ("forward", "plain"), ("forward", "bias+relu"), ("backward_data", "plain"),
        ("backward_data", "relu mask"), ("backward_weight", "warm")}
    for (phase, algo, variant), fn in calls.items():
        if phase == "forward" and variant == "plain":
            fn()
            plain = t["y"].clone()
            calls[(phase, algo, "bias+relu")]()
            want = (plain + t["b"][None, :, None, None]).clamp(min=0)
            torch.testing.assert_close(t["y"], want, rtol=1e-5, atol=1e-5)
        if phase == "backward_data" and variant == "plain":
            fn()
            plain = t["dx"].clone()
            calls[(phase, algo, "relu mask")]()
            assert torch.equal(t["dx"], torch.where(t["relu_out"] <= 0, 0.0, plain)), algo
    t["dw"].fill_(float("nan"))
    t["db"].fill_(float("nan"))
    calls[("backward_weight", "splitk", "warm")]()
    torch.testing.assert_close(t["db"], t["dy"].sum((0, 2, 3)), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(t["dw"]).all()


def test_it_refuses_a_machine_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        conv_gap.main(["--out", str(tmp_path / "gap.json")])
