"""Checkpoints: rt.state_dict()/load_state_dict() and tinysn.checkpoint resume a run bitwise;
damaged files fail with one clear error; a real killed training process resumes exactly."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tinysn as sn
from tinysn import checkpoint
from tinysn.checkpoint import CheckpointError
from tinysn.testing import block_net

ROOT = Path(__file__).resolve().parents[1]


def _batches(net, count, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn((net.batch, *net.input_shape), generator=gen),
             torch.randint(0, net.classes, (net.batch,), generator=gen)) for _ in range(count)]


def _runtime(net, policy="recompute", seed=7, device="cpu"):
    return sn.Runtime(net, "64MiB", policy, device=device, lr=0.1, momentum=0.9, seed=seed,
                      conv_algos={})


def _assert_states_equal(a, b):
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_state_dict_holds_params_bn_stats_momentum_iteration_and_seed():
    net = block_net(batch=2, p=0.3)
    rt = _runtime(net)
    rt.step(*_batches(net, 1)[0])
    state = rt.state_dict()
    assert state["iteration"].item() == 1 and state["seed"].item() == 7
    for name in net.param_shapes():
        assert name + ".momentum_buffer" in state and state[name + ".momentum_buffer"].any()
    assert set(net.buffer_shapes()) < set(state)


def _check_resume(tmp_path, device):
    """Dropout (its masks depend on seed and iteration), batch norm (running statistics)
    and momentum all carry over; the resumed Runtime even has another seed and policy."""
    net = block_net(batch=2, p=0.3)
    batches = [(x.to(device), y.to(device)) for x, y in _batches(net, 4)]
    straight = _runtime(net, device=device)
    for images, labels in batches:
        straight.step(images, labels)
    first = _runtime(net, device=device)
    for images, labels in batches[:2]:
        first.step(images, labels)
    path = tmp_path / "run.safetensors"
    checkpoint.save(first, path)
    resumed = _runtime(net, policy="baseline", seed=123, device=device)
    header = checkpoint.load(resumed, path)
    assert header["net"] == checkpoint.fingerprint(net)
    assert resumed.stats.iterations == 2 and resumed.seed == 7
    for images, labels in batches[2:]:
        resumed.step(images, labels)
    _assert_states_equal(straight.state_dict(), resumed.state_dict())


def test_resume_from_a_file_is_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    _check_resume(tmp_path, "cpu")


@pytest.mark.gpu
def test_resume_on_the_gpu_is_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    _check_resume(tmp_path, "cuda")


def test_load_state_dict_checks_everything_before_changing_anything():
    """Each bad state differs from a valid one (every value changed) by one defect; none of
    its values may land. The valid one then loads whole."""
    net = block_net(batch=2, p=0.0)
    rt = _runtime(net)
    good = rt.state_dict()
    changed = {**{k: v + 1 for k, v in good.items() if v.is_floating_point()},
               "iteration": torch.tensor(3), "seed": torch.tensor(1)}
    name = next(iter(net.param_shapes()))
    bad = [({k: v for k, v in changed.items() if k != "iteration"}, r"missing \['iteration'\]"),
           ({**changed, "extra": torch.zeros(1)}, r"unknown names \['extra'\]"),
           ({**changed, name: changed[name].double()}, f"{name} must be"),
           ({**changed, name: changed[name][:1]}, f"{name} must be"),
           ({**changed, "seed": torch.tensor(-1)}, "seed must be >= 0")]
    for state, match in bad:
        with pytest.raises(ValueError, match=match):
            rt.load_state_dict(state)
        _assert_states_equal(rt.state_dict(), good)
    rt.load_state_dict(changed)
    _assert_states_equal(rt.state_dict(), changed)
    assert rt.stats.iterations == 3 and rt.seed == 1


def _saved(tmp_path, net=None):
    net = net or block_net(batch=2, p=0.0)
    rt = _runtime(net)
    rt.step(*_batches(net, 1)[0])
    path = tmp_path / "ck.safetensors"
    checkpoint.save(rt, path)
    return rt, path


@pytest.mark.parametrize("damage,match", [
    (lambda b: b[:len(b) - 7], "not a readable tinysn checkpoint"),                   # torn
    (lambda b: b[:-40] + bytes([b[-40] ^ 1]) + b[-39:], "does not match its checksum"),
    (lambda b: b"\x00" * 16, "not a readable tinysn checkpoint"),
    (lambda b: b"", "not a readable tinysn checkpoint"),
])
def test_a_damaged_file_fails_with_one_clear_error_and_changes_nothing(tmp_path, damage, match):
    rt, path = _saved(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    before = rt.state_dict()
    with pytest.raises(CheckpointError, match=match) as info:
        checkpoint.load(rt, path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    _assert_states_equal(rt.state_dict(), before)


def test_another_nets_checkpoint_or_a_missing_file_is_refused(tmp_path):
    _, path = _saved(tmp_path)
    other = _runtime(block_net(batch=2, p=0.5))
    with pytest.raises(CheckpointError, match="different net"):
        checkpoint.load(other, path)
    with pytest.raises(CheckpointError, match="no such file"):
        checkpoint.load(other, tmp_path / "absent.safetensors")


def test_a_failed_write_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    rt, path = _saved(tmp_path)
    old = path.read_bytes()
    rt.step(*_batches(rt.net, 1, seed=9)[0])

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(rt, path)
    assert path.read_bytes() == old and sorted(os.listdir(tmp_path)) == [path.name]


# ------------------------------------------------------------------ a real killed process
def _train(path, *extra):
    return [sys.executable, "-m", "tinysn", "train", "--model", "lenet", "--data", "digits",
            "--device", "cpu", "--steps", "6", "--batch", "8", "--seed", "1",
            "--save", str(path), *extra]


def test_cli_run_killed_after_a_checkpoint_resumes_to_bitwise_the_same_parameters(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    full = tmp_path / "full.safetensors"
    subprocess.run(_train(full), cwd=ROOT, env=env, check=True, capture_output=True)
    part = tmp_path / "part.safetensors"
    proc = subprocess.Popen(_train(part, "--save-every", "2"), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not part.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    tensors, _ = checkpoint.read(part)
    assert tensors["iteration"].item() in (2, 4)            # killed part way
    out = subprocess.run(_train(part, "--resume", str(part)), cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert "held-out accuracy" in out
    resumed, straight = checkpoint.read(part)[0], checkpoint.read(full)[0]
    assert resumed["iteration"].item() == 6
    _assert_states_equal(resumed, straight)


def test_cli_refuses_save_every_without_save_and_a_damaged_resume(tmp_path, capsys):
    from tinysn import cli
    base = ["train", "--model", "lenet", "--data", "digits", "--device", "cpu", "--steps", "1",
            "--batch", "8"]
    assert cli.main(base + ["--save-every", "2"]) == 2
    assert "--save-every K needs" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    assert cli.main(base + ["--resume", str(bad)]) == 2
    assert "not a readable tinysn checkpoint" in capsys.readouterr().err


def test_load_params_takes_a_torch_state_dict_skipping_only_batch_norm_counters():
    """Batch norms' num_batches_tracked (torch's BatchNorm2d keeps them, tinysn does not)
    are skipped; the same name on a layer without one is an unknown name, and nothing
    changes."""
    net = block_net(batch=2, p=0.0)
    rt = _runtime(net, policy="baseline")
    norms = [layer.name for layer in net.layers if layer.buffers]
    conv = next(layer.name for layer in net.layers if layer.params and not layer.buffers)
    assert norms
    state = {**net.to_torch(seed=11).state_dict(),
             **{f"{name}.num_batches_tracked": torch.tensor(3) for name in norms}}
    rt.load_params(state)
    for name, value in rt.params().items():
        assert torch.equal(value, state[name]), name
    before = rt.params()
    with pytest.raises(ValueError, match=rf"unknown names \['{conv}.num_batches_tracked'\]"):
        rt.load_params({**net.to_torch(seed=12).state_dict(),
                        f"{conv}.num_batches_tracked": torch.tensor(0)})
    _assert_states_equal(rt.params(), before)
