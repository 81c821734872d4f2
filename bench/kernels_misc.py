"""ReLU, fully connected, softmax + cross-entropy, dropout and SGD kernels against torch.

    PYTHONPATH=. python bench/kernels_misc.py [--batch 32] [--only relu,linear,...] [--out PATH]

bench(device="cuda") -> list of rows {"kernel", "algo", "shape", "tinysn_ms", "torch_ms",
"ratio" (torch_ms / tinysn_ms), "gbps" (memory-bound kernels: bytes read + written once, per
tinysn time) or "tflops" (fc GEMMs), "torch_gbps"/"torch_tflops", "copy_gbps" (torch's
device-to-device copy of a ResNet-50 activation, measured in the same run: the bandwidth a
memory-bound kernel can hope for) and "frac_of_copy" (gbps / copy_gbps), "rel_err" where the
outputs are comparable}. Shapes: ResNet-50 at batch 32 (relu on [32,256,56,56], fc 2048->1000,
softmax on [32,1000], SGD on its 25.6M parameters), dropout on [32,4096] (AlexNet/VGG fc
width) plus one large activation, and VGG-16's fc6 (25088->4096) as a large skinny GEMM.
torch equivalents: clamp(out=) / threshold_backward(grad_input=), addmm / mm / sum (out=),
F.cross_entropy (+ autograd.grad), native_dropout / native_dropout_backward (torch also writes
a bool mask), torch.optim.SGD (foreach; fused also reported). TF32 on both sides for "tf32"
rows, exact float32 on both for "ieee". Times: triton.testing.do_bench medians (warmup 25 ms,
rep 100 ms), everything allocated outside the timed function.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401  (before triton: interpreter switch when there is no GPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402,F401
from bench import common  # noqa: E402
from tinysn.kernels import act, dropout, linear, sgd, softmax  # noqa: E402

GROUPS = ("relu", "linear", "softmax", "dropout", "sgd")
LINEAR_SHAPES = (("resnet50 fc", 2048, 1000), ("vgg16 fc6", 25088, 4096))   # (name, F, O)
SGD_NUMEL = 25_557_032   # ResNet-50's parameter count


_do_bench, _rel, _shape = common.do_bench, common.rel_err, common.shape_str


def _bench_relu(r, device, batch):
    shape = (batch, 256, 56, 56)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g)
    dy = torch.randn(shape, device=device, generator=g)
    y, dx, ty, tdx = (torch.empty_like(x) for _ in range(4))
    n = x.numel()

    def tb():
        torch.ops.aten.threshold_backward.grad_input(dy, y, 0.0, grad_input=tdx)

    r.run("act.forward", "relu", _shape(shape), lambda: act.forward(x, y),
          lambda: torch.clamp(x, min=0.0, out=ty), nbytes=8 * n, check=lambda: _rel(y, ty))
    r.run("act.backward", "relu", _shape(shape), lambda: act.backward(y, dy, dx),
          tb, nbytes=12 * n, check=lambda: _rel(dx, tdx))
    dx.copy_(dy)
    r.run("act.backward", "relu+accumulate", _shape(shape),
          lambda: act.backward(y, dy, dx, accumulate=True),
          lambda: tdx.add_(torch.ops.aten.threshold_backward(dy, y, 0.0)), nbytes=16 * n)


def _bench_linear(r, device, batch):
    for name, f, o in LINEAR_SHAPES:
        n = batch
        g = torch.Generator(device=device).manual_seed(f)
        x = torch.randn(n, f, device=device, generator=g)
        w = torch.randn(o, f, device=device, generator=g) * f ** -0.5
        b = torch.randn(o, device=device, generator=g)
        dy = torch.randn(n, o, device=device, generator=g)
        y, ty = torch.empty(n, o, device=device), torch.empty(n, o, device=device)
        dx, tdx = torch.empty_like(x), torch.empty_like(x)
        dw, tdw = torch.empty_like(w), torch.empty_like(w)
        db, tdb = torch.empty_like(b), torch.empty_like(b)
        shape = f"{name} {n}x{f}->{o}"
        gemm = 2 * n * f * o
        for prec in ("tf32", "ieee"):
            torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"

            def t_dx():
                torch.mm(dy, w, out=tdx)

            def t_dwdb():
                torch.mm(dy.t(), x, out=tdw)
                torch.sum(dy, 0, out=tdb)

            def t_bwd():
                t_dx()
                t_dwdb()

            r.run("linear.forward", prec, shape,
                  lambda: linear.forward(x, w, b, y, precision=prec),
                  lambda: torch.addmm(b, x, w.t(), out=ty), flops=gemm,
                  check=lambda: _rel(y, ty))
            r.rows[-1]["config"] = _config()
            r.run("linear.backward", prec + " dx", shape,
                  lambda: linear.backward(x, w, dy, dx, None, None, precision=prec),
                  t_dx, flops=gemm, check=lambda: _rel(dx, tdx))
            r.rows[-1]["config"] = _config()
            r.run("linear.backward", prec + " dw+db", shape,
                  lambda: linear.backward(x, w, dy, None, dw, db, precision=prec),
                  t_dwdb, flops=gemm, check=lambda: max(_rel(dw, tdw), _rel(db, tdb)))
            r.rows[-1]["config"] = _config()
            r.run("linear.backward", prec + " all", shape,
                  lambda: linear.backward(x, w, dy, dx, dw, db, precision=prec),
                  t_bwd, flops=2 * gemm)
        torch.backends.cuda.matmul.allow_tf32 = True
        del x, w, dy, dx, tdx, dw, tdw


def _config():
    best = getattr(linear._gemm_kernel, "best_config", None)
    return None if best is None else f"{best.kwargs} w{best.num_warps} s{best.num_stages}"


def _bench_softmax(r, device, batch):
    for n, k in ((batch, 1000), (batch * 8, 1000)):
        g = torch.Generator(device=device).manual_seed(k)
        logits = torch.randn(n, k, device=device, generator=g) * 3
        labels = torch.randint(0, k, (n,), device=device, generator=g)
        loss = torch.empty(1, device=device)
        ws = torch.empty(max(softmax.workspace_bytes(n, k), 4), dtype=torch.uint8, device=device)
        dl = torch.empty_like(logits)
        lg = logits.clone().requires_grad_(True)

        def t_both():
            return torch.autograd.grad(F.cross_entropy(lg, labels), lg)[0]

        def sn_both():
            softmax.forward(logits, labels, loss, ws)
            softmax.backward(logits, labels, dl)

        r.run("softmax.forward", "cross_entropy", f"{n}x{k}",
              lambda: softmax.forward(logits, labels, loss, ws),
              lambda: F.cross_entropy(logits, labels), nbytes=4 * n * k + 8 * n + 4,
              check=lambda: _rel(loss, F.cross_entropy(logits, labels).reshape(1)))
        r.run("softmax.forward+backward", "cross_entropy", f"{n}x{k}", sn_both, t_both,
              nbytes=12 * n * k + 16 * n + 4, check=lambda: _rel(dl, t_both()))


def _bench_dropout(r, device, batch):
    for shape in ((batch, 4096), (batch, 256, 56, 56)):
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(shape, device=device, generator=g)
        dy = torch.randn(shape, device=device, generator=g)
        y, dx = torch.empty_like(x), torch.empty_like(x)
        _, mask = torch.native_dropout(x, 0.5, True)
        n = x.numel()
        step = torch.zeros(1, dtype=torch.int64, device=device)   # the runtime's step counter
        mask_of = dict(p=0.5, seed=1234, iteration=step, layer=3, offset=5 * n)
        r.run("dropout.forward", "p=0.5", _shape(shape),
              lambda: dropout.forward(x, y, **mask_of),
              lambda: torch.native_dropout(x, 0.5, True), nbytes=8 * n)
        r.rows[-1]["keep_fraction"] = (y != 0).double().mean().item()
        r.run("dropout.backward", "p=0.5", _shape(shape),
              lambda: dropout.backward(dy, dx, **mask_of),
              lambda: torch.ops.aten.native_dropout_backward(dy, mask, 2.0), nbytes=8 * n)


def _bench_sgd(r, device, batch):
    n = SGD_NUMEL
    g = torch.Generator(device=device).manual_seed(2)
    p = torch.randn(n, device=device, generator=g)
    grad = torch.randn(n, device=device, generator=g) * 1e-3
    buf = torch.zeros(n, device=device)
    tp = p.clone().requires_grad_(True)
    tp.grad = grad.clone()
    for mom, wd in ((0.9, 1e-4), (0.0, 0.0)):
        opt = torch.optim.SGD([tp], lr=1e-3, momentum=mom, weight_decay=wd, foreach=True)
        row = r.run("sgd.update", f"momentum={mom} wd={wd}", f"{n}",
                    lambda: sgd.update(p, grad, buf, lr=1e-3, momentum=mom, weight_decay=wd),
                    opt.step, nbytes=(20 if mom else 12) * n)
        try:
            fused = torch.optim.SGD([tp], lr=1e-3, momentum=mom, weight_decay=wd, fused=True)
            fused.step()
            row["torch_fused_ms"] = _do_bench(fused.step)
        except Exception as e:  # older torch: no fused SGD
            row["torch_fused_ms"] = f"unavailable: {type(e).__name__}"
        del opt


def bench(device="cuda", batch=32, only=GROUPS, log=print):
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    r = common.Runner(log, _fmt)   # no graph timing: torch's dropout RNG cannot be captured
    r.copy_gbps = common.copy_gbps(device)
    log(f"torch copy: {r.copy_gbps:.0f} GB/s")
    for group in GROUPS:
        if group in only:
            globals()[f"_bench_{group}"](r, device, batch)
            torch.cuda.empty_cache()
    return r.rows


def _fmt(row):
    head = f"{row['kernel']:<26}{row['algo']:<24}{row['shape']:<34}"
    if "error" in row:
        return head + " ERROR " + row["error"][:300]
    rate = (f"{row['gbps']:7.0f} GB/s ({row.get('frac_of_copy', 0):.0%} of copy)" if "gbps" in row
            else f"{row['tflops']:7.1f} TFLOP/s (torch {row['torch_tflops']:.1f})")
    err = f"  err {row['rel_err']:.1e}" if "rel_err" in row else ""
    return head + (f"{row['tinysn_ms']:9.4f}{row['torch_ms']:9.4f}{row['ratio']:7.2f}  {rate}{err}"
                   + common.graph_note(row))


def main():
    common.group_main(bench, GROUPS, f"{'kernel':<26}{'algo':<24}{'shape':<34}"
                                     f"{'tinysn':>9}{'torch':>9}{'ratio':>7}")


if __name__ == "__main__":
    main()
