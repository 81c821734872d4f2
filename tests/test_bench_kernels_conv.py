"""bench/kernels_conv.py's kernel table: each row reports the config of the autotuner that ran
its algorithm (the GPU timing itself runs only on the device machine)."""
import torch

from bench import kernels_conv
from tinysn.kernels import conv


def test_each_algorithm_reports_the_autotuner_its_gemm_ran_under(monkeypatch, conv_phase):
    """Every algorithm of every phase, run once on a small conv every algorithm applies to:
    the last autotuned kernel it launched is the one whose pick its row reports."""
    ran = []
    launch = conv._launch
    monkeypatch.setattr(conv, "_launch", lambda tuner, *args: (ran.append(tuner),
                                                                launch(tuner, *args)))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(8, 4, 3, 3, generator=gen)
    dy = torch.randn(1, 8, 8, 8, generator=gen)
    for phase in conv.PHASES:
        for algo in conv._ALGOS[phase]:
            ran.clear()
            conv_phase(phase, algo, x, w, dy)
            name = kernels_conv._TUNED_ALGO.get((phase, algo), kernels_conv._TUNED[phase])
            assert ran and ran[-1] is getattr(conv, name), f"{phase} {algo}: {name}"
