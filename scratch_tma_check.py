"""One-off GPU check of the "tma" weight gradient (not committed)."""
import sys, time
sys.path.insert(0, "tests/kernels")
import torch
import tinysn  # noqa
from tinysn.kernels import conv
from configs import pinned

shapes = [(4, 64, 64, 28, 3), (4, 128, 96, 14, 3), (4, 64, 32, 7, 3), (4, 96, 64, 14, 1),
          (4, 64, 128, 7, 1), (4, 32, 48, 17, 3), (2, 16, 24, 12, 5)]
worst = {}
for idx in range(len(conv._WGT_TMA_CONFIGS)):
    with pinned(conv, idx):
        for (n, c, k, hw, r) in shapes:
            pad = r // 2
            x = torch.randn(n, c, hw, hw, device="cuda")
            dy = torch.randn(n, k, hw, hw, device="cuda")
            ref = torch.nn.grad.conv2d_weight(x.double(), (k, c, r, r), dy.double(), 1, pad)
            for prec in ("ieee", "tf32"):
                need = conv.workspace_bytes(x.shape, (k, c, r, r), 1, pad, "backward_weight", "tma")
                ws = torch.full((need // 4 + 1,), float("nan"), device="cuda")
                dw = torch.full((k, c, r, r), float("nan"), device="cuda")
                conv.backward_weight(x, dy, dw, None, stride=1, padding=pad, algo="tma",
                                     workspace=ws, precision=prec)
                torch.cuda.synchronize()
                err = ((dw.double() - ref).norm() / ref.norm()).item()
                key = (prec,)
                worst[key] = max(worst.get(key, 0), err if err == err else 1e9)
                print(idx, (n, c, k, hw, r), prec, f"{err:.2e}", flush=True)
print("worst", worst)
assert worst[("ieee",)] < 1e-5 and worst[("tf32",)] < 2e-3, worst
print("TMA CHECK PASSED")
