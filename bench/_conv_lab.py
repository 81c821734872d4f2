"""Temporary lab script for the conv kernels (device experiments); not part of the suite."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401
import torch  # noqa: E402
import triton  # noqa: E402
from tinysn.kernels import conv  # noqa: E402

torch.backends.cudnn.allow_tf32 = True
torch.backends.cuda.matmul.allow_tf32 = True


def launch_raw(kind, shape, bm, bn, bk, warps, stages, pix, reps=3):
    C, H, W, K, R, S, st, pd = shape
    N = 32
    dev = "cuda"
    x = torch.randn(N, C, H, W, device=dev)
    w = torch.randn(K, C, R, S, device=dev)
    _, _, P, Q = conv.out_shape(x.shape, w.shape, st, pd)
    dy = torch.randn(N, K, P, Q, device=dev)
    is1 = R == 1 and S == 1 and st == 1 and pd == 0
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PIX=pix, num_warps=warps,
                num_stages=stages)
    for _ in range(reps):
        if kind == "fwd":
            y = torch.empty(N, K, P, Q, device=dev)
            grid = (triton.cdiv(N * P * Q, bm) * triton.cdiv(K, bn),)
            conv._conv_fwd_kernel[grid](x, w, y, y, N, C, K, st, st, pd, pd, H=H, W=W, P=P, Q=Q,
                                        R=R, S=S, IS_1X1=is1, HAS_BIAS=False, PRECISION="tf32",
                                        **meta)
        elif kind == "data":
            dx = torch.empty_like(x)
            grid = (triton.cdiv(N * H * W, bm) * triton.cdiv(C, bn), 1)
            conv._conv_bwd_data_kernel[grid](dy, w, dx, N, C, K, st, st, pd, pd, H=H, W=W, P=P,
                                             Q=Q, R=R, S=S, IS_1X1=is1, STRIDE1=True,
                                             ACCUMULATE=False, PRECISION="tf32", **meta)
        else:
            dw = torch.empty_like(w)
            grid = (triton.cdiv(K, bm) * triton.cdiv(C * R * S, bn), 1)
            conv._conv_bwd_weight_kernel[grid](x, dy, dw, N, C, K, st, st, pd, pd, N * P * Q,
                                               H=H, W=W, P=P, Q=Q, R=R, S=S, IS_1X1=is1,
                                               PRECISION="tf32", **meta)
    torch.cuda.synchronize()


def gemm_baselines():
    """cuBLAS TF32 on the GEMMs that the 1x1 convs are (NHWC-style, contiguous operands)."""
    for (m, n, k, name) in [(32 * 3136, 64, 64, "1x1 64->64 @56"), (32 * 3136, 256, 64, "1x1 64->256 @56"),
                            (32 * 196, 256, 1024, "1x1 1024->256 @14")]:
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(k, n, device="cuda")
        ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
        print(f"cublas {name:<22} {ms:.4f} ms  {2 * m * n * k / ms * 1e-9:.1f} TFLOP/s", flush=True)
    x = torch.randn(256 * 1024 * 1024 // 4, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100, return_mode="median")
    print(f"copy 256MB: {ms:.3f} ms  {2 * x.numel() * 4 / ms * 1e-9:.0f} GB/s", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "gemm":
        gemm_baselines()
    else:
        kind, name = sys.argv[1], sys.argv[2]
        shapes = {"3x3_128": (128, 28, 28, 128, 3, 3, 1, 1), "1x1_256": (64, 56, 56, 256, 1, 1, 1, 0),
                  "3x3_256": (256, 14, 14, 256, 3, 3, 1, 1), "1x1_1024": (1024, 14, 14, 256, 1, 1, 1, 0)}
        bm, bn, bk, w, st, pix = (int(v) for v in sys.argv[3].split(","))
        launch_raw(kind, shapes[name], bm, bn, bk, w, st, bool(pix))
