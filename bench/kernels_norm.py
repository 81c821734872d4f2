"""Batch norm, pooling, join (add, concat) and LRN kernels against torch, same process.

    PYTHONPATH=. python bench/kernels_norm.py [--batch 32] [--only bn,pool,join,lrn] [--out PATH]

bench(device="cuda") -> list of rows {"kernel", "algo", "shape", "tinysn_ms", "torch_ms",
"ratio" (torch_ms / tinysn_ms), "gbps" (bytes each kernel must read + write once, per tinysn
time: the figure a single-pass kernel could reach), "torch_gbps", "copy_gbps" (torch's
device-to-device copy of a ResNet-50 activation in the same run: the bandwidth a memory-bound
kernel can hope for), "frac_of_copy" (gbps / copy_gbps), "moved_gbps" where tinysn reads more
than the minimum (bn reads x twice: the bytes it actually moves, per its time), "rel_err"
where outputs are comparable}.

Shapes (ResNet-50 at batch 32, AlexNet for LRN, VGG16 for the tiling max pool):
  bn        [32,64,112,112], [32,256,56,56] and [32,1024,14,14] (training mode; backward: dx,
            dgamma, dbeta; on the second, forward and backward with a residual add fused in
            and apart; the third takes the one-launch form, bn._one_program)
  maxpool   3x3 / 2 pad 1 on [32,64,112,112], and VGG16's 2x2 / 2 on [32,64,224,224]
  avgpool   7x7 on [32,2048,7,7]                  (the global pool)
  add       two [32,256,56,56]                    (backward: 2 gradients, copy and accumulate)
  concat    two [32,128,28,28]
  lrn       size 5 on [32,96,55,55]
torch equivalents: F.batch_norm / native_batch_norm(_backward); max_pool2d_with_indices
(+ its backward, which reads torch's int64 indices); avg_pool2d(_backward); add(out=), copy_;
cat(out=) and slice copies; F.local_response_norm and autograd.grad through it (a composite
of several torch kernels). Times: triton.testing.do_bench medians (warmup 25 ms, rep 100 ms),
everything allocated outside the timed function.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401  (before triton: interpreter switch when there is no GPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402,F401
from bench import common  # noqa: E402
from tinysn.kernels import bn, join, lrn, pool  # noqa: E402

GROUPS = ("bn", "pool", "join", "lrn")


_do_bench, _rel, _shape = common.do_bench, common.rel_err, common.shape_str


def _randn(shape, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, device=device, generator=g)


def _bench_bn(r, device, batch):
    for shape in [(batch, 64, 112, 112), (batch, 256, 56, 56), (batch, 1024, 14, 14)]:
        c = shape[1]
        form = "one launch" if bn._one_program(shape[0], c, shape[2] * shape[3]) else "3-pass"
        x, dy = _randn(shape, device, 1), _randn(shape, device, 2)
        gamma, beta = _randn((c,), device, 3), _randn((c,), device, 4)
        rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
        trm, trv = rm.clone(), rv.clone()
        y, dx = torch.empty_like(x), torch.empty_like(x)
        saved = torch.empty(2, c, device=device)
        wsf = torch.empty(bn.workspace_bytes(shape, "forward"), dtype=torch.uint8, device=device)
        wsb = torch.empty(bn.workspace_bytes(shape, "backward"), dtype=torch.uint8, device=device)
        dg, db = torch.empty(c, device=device), torch.empty(c, device=device)
        s = x.numel() * 4
        _, smean, sinv = torch.ops.aten.native_batch_norm(x, gamma, beta, trm.clone(), trv.clone(),
                                                          True, 0.1, 1e-5)

        def t_fwd():
            torch.ops.aten.native_batch_norm(x, gamma, beta, trm, trv, True, 0.1, 1e-5)

        def t_fwd_f():
            F.batch_norm(x, trm, trv, gamma, beta, training=True, momentum=0.1, eps=1e-5)

        def t_bwd():
            torch.ops.aten.native_batch_norm_backward(dy, x, gamma, trm, trv, smean, sinv, True,
                                                      1e-5, [True, True, True])

        r.run("bn.forward", form, _shape(shape),
              lambda: bn.forward(x, gamma, beta, y, rm, rv, saved, wsf),
              t_fwd, nbytes=2 * s, moved=3 * s, torch_op="native_batch_norm",
              check=lambda: _rel(y, F.batch_norm(x, None, None, gamma, beta, training=True)))
        r.run("bn.forward", f"{form} vs F.batch_norm", _shape(shape),
              lambda: bn.forward(x, gamma, beta, y, rm, rv, saved, wsf),
              t_fwd_f, nbytes=2 * s, moved=3 * s, torch_op="F.batch_norm (cudnn if chosen)")
        bn.forward(x, gamma, beta, y, rm, rv, saved, wsf)

        def check_bwd():
            ref = torch.ops.aten.native_batch_norm_backward(dy, x, gamma, trm, trv, smean, sinv,
                                                            True, 1e-5, [True, True, True])
            return max(_rel(dx, ref[0]), _rel(dg, ref[1]), _rel(db, ref[2]))

        r.run("bn.backward", f"{form} dx+dgamma+dbeta", _shape(shape),
              lambda: bn.backward(x, gamma, dy, saved, dx, dg, db, wsb),
              t_bwd, nbytes=3 * s, moved=5 * s, torch_op="native_batch_norm_backward",
              check=check_bwd)
        if c == 256:        # a ResNet-50 block's output: its last batch norm and the add
            _bench_bn_residual(r, shape, x, gamma, beta, rm, rv, saved, wsf, dy, y, dx)
            _bench_bn_residual_backward(r, shape, x, gamma, saved, wsb, dy, y, dx, dg, db,
                                        (smean, sinv, trm, trv))
        del x, dy, y, dx


def _bench_bn_residual_backward(r, shape, x, gamma, saved, ws, dy, mask, dx, dg, db, stats):
    """The backward of a batch norm with its residual add and the add's ReLU fused in
    (bn.backward's `relu_output` and `dy_out`: the residual's gradient stored by the first
    kernel) and the two apart (join.add_backward's masked fan-out, then bn.backward), each
    against PyTorch's pair (the ReLU's backward, then native_batch_norm_backward)."""
    s = x.numel() * 4
    d_res, d_branch = torch.empty_like(x), torch.empty_like(x)
    smean, sinv, trm, trv = stats

    def t_pair():
        g = torch.where(mask <= 0, 0.0, dy)
        torch.ops.aten.native_batch_norm_backward(g, x, gamma, trm, trv, smean, sinv, True,
                                                  1e-5, [True, True, True])

    def apart():
        join.add_backward(dy, [d_branch, d_res], y=mask)
        bn.backward(x, gamma, d_branch, saved, dx, dg, db, ws)
    r.run("bn.backward", "residual add + ReLU fused, dy stored", _shape(shape),
          lambda: bn.backward(x, gamma, dy, saved, dx, dg, db, ws, relu_output=mask,
                              dy_out=d_res),
          t_pair, nbytes=5 * s, moved=7 * s, torch_op="ReLU backward + native_bn_backward")
    r.run("bn.backward", "join.add_backward, then bn.backward", _shape(shape), apart,
          t_pair, nbytes=5 * s, moved=9 * s, torch_op="ReLU backward + native_bn_backward")


def _bench_bn_residual(r, shape, x, gamma, beta, rm, rv, saved, ws, res, y, out):
    """The batch norm with its residual add fused in (`residual=`, sched/fuse.py) and the
    two apart (bn.forward into `y`, then join.add_forward into `out`), each against
    PyTorch's pair (native_batch_norm, then add): the fused pass's gain is the ratio of
    the two rows' tinysn times."""
    c, s = shape[1], x.numel() * 4
    trm, trv = rm.clone(), rv.clone()
    ty = torch.empty_like(x)

    def t_pair():
        torch.add(torch.ops.aten.native_batch_norm(x, gamma, beta, trm, trv, True, 0.1,
                                                   1e-5)[0], res, out=ty)

    def ref():
        return F.batch_norm(x, None, None, gamma, beta, training=True) + res
    r.run("bn.forward", "3-pass, residual add fused", _shape(shape),
          lambda: bn.forward(x, gamma, beta, out, rm, rv, saved, ws, residual=res),
          t_pair, nbytes=3 * s, moved=4 * s, torch_op="native_batch_norm + add",
          check=lambda: _rel(out, ref()))
    r.run("bn.forward", "3-pass, then join.add_forward", _shape(shape),
          lambda: (bn.forward(x, gamma, beta, y, rm, rv, saved, ws),
                   join.add_forward([y, res], out)),
          t_pair, nbytes=3 * s, moved=6 * s, torch_op="native_batch_norm + add",
          check=lambda: _rel(out, ref()))


def _bench_stored_argmax(r, name, x, relu_x, y, dy, dx, tdx, kw, t_fwd, t_bwd, t_bwd_relu):
    """The max pool as a plan that fits unmoved runs it: the forward stores each window's
    argmax byte, the backward reads those instead of x (through the ReLU before the pool
    too: the bytes' sign bit). Bytes counted: what each kernel reads and writes."""
    arg = torch.empty(y.shape, dtype=torch.uint8, device=x.device)
    sx, sy, sa = x.numel() * 4, y.numel() * 4, arg.numel()
    r.run("pool.forward", "max, storing its argmax bytes", name,
          lambda: pool.forward(x, y, argmax=arg, **kw), t_fwd, nbytes=sx + sy + sa,
          check=lambda: _rel(y, F.max_pool2d(x, kw["kernel"], kw["stride"], kw["padding"])),
          torch_op="max_pool2d_with_indices (also writes int64 indices)")
    r.run("pool.backward", "max from the argmax bytes its forward stored", name,
          lambda: pool.backward(None, None, dy, dx, argmax=arg, **kw), t_bwd,
          nbytes=sy + sa + sx, check=lambda: _rel(dx, tdx),
          torch_op="max_pool2d_with_indices_backward")
    relu_arg = torch.empty_like(arg)
    pool.forward(relu_x, torch.empty_like(y), argmax=relu_arg, **kw)
    r.run("pool.backward", "max from the stored argmax bytes, through the ReLU before it",
          name, lambda: pool.backward(None, None, dy, dx, argmax=relu_arg,
                                      x_is_relu_output=True, **kw),
          t_bwd_relu, nbytes=sy + sa + sx,
          torch_op="max_pool2d_with_indices_backward, threshold_backward")


def _bench_pool(r, device, batch):
    cases = [("max", (batch, 64, 112, 112), 3, 2, 1), ("max", (batch, 64, 224, 224), 2, 2, 0),
             ("avg", (batch, 2048, 7, 7), 7, 7, 0)]
    for mode, shape, k, st, p in cases:
        x = _randn(shape, device, 5)
        oshape = pool.out_shape(shape, k, st, p)
        dy = _randn(oshape, device, 6)
        y, ty = torch.empty(oshape, device=device), torch.empty(oshape, device=device)
        dx, tdx = torch.empty_like(x), torch.empty_like(x)
        sx, sy = x.numel() * 4, y.numel() * 4
        kw = dict(mode=mode, kernel=k, stride=st, padding=p)
        name = f"{_shape(shape)} k{k} s{st} p{p}"
        if mode == "max":
            _, idx = torch.ops.aten.max_pool2d_with_indices(x, [k, k], [st, st], [p, p])

            def t_fwd():
                torch.ops.aten.max_pool2d_with_indices(x, [k, k], [st, st], [p, p])

            def t_bwd():
                torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
                    dy, x, [k, k], [st, st], [p, p], [1, 1], False, idx, grad_input=tdx)

            r.run("pool.forward", "max", name, lambda: pool.forward(x, y, **kw), t_fwd,
                  nbytes=sx + sy, check=lambda: _rel(y, F.max_pool2d(x, k, st, p)),
                  torch_op="max_pool2d_with_indices (also writes int64 indices)")
            room = pool.argmax_workspace_bytes(shape, **kw)
            r.run("pool.backward", "max (argmax recomputed from x)" if room else
                  "max (windows tile the input)", name,
                  lambda: pool.backward(x, y, dy, dx, **kw), t_bwd, nbytes=sx + sy + sx,
                  check=lambda: _rel(dx, tdx), torch_op="max_pool2d_with_indices_backward")
            relu_x = x.clamp(min=0)

            def t_bwd_relu():
                t_bwd()
                torch.ops.aten.threshold_backward.grad_input(tdx, relu_x, 0.0, grad_input=tdx)

            _bench_stored_argmax(r, name, x, relu_x, y, dy, dx, tdx, kw, t_fwd, t_bwd,
                                 t_bwd_relu)
            if not room:        # no argmax workspace for windows that do not overlap
                continue
            ws = torch.empty(room, dtype=torch.uint8, device=device)
            r.run("pool.backward", "max (argmax found once, into a uint8 workspace)", name,
                  lambda: pool.backward(x, y, dy, dx, workspace=ws, **kw), t_bwd,
                  nbytes=sx + sy + sx, check=lambda: _rel(dx, tdx),
                  torch_op="max_pool2d_with_indices_backward")
            params = pool._params(k, st, p)
            r.run("pool.backward", "max, its argmax pass alone", name,
                  lambda: pool._find_argmaxes(x, ws, oshape[2], oshape[3], params), t_fwd,
                  nbytes=sx + room, torch_op="max_pool2d_with_indices (its forward)")
            r.run("pool.backward", "max from the workspace, through the ReLU before it", name,
                  lambda: pool.backward(relu_x, y, dy, dx, workspace=ws, x_is_relu_output=True,
                                        **kw), t_bwd_relu, nbytes=sx + sy + sx + sx,
                  torch_op="max_pool2d_with_indices_backward, threshold_backward")
        else:
            def t_fwd():
                torch.ops.aten.avg_pool2d.out(x, [k, k], [st, st], [p, p], False, True, None,
                                              out=ty)

            def t_bwd():
                torch.ops.aten.avg_pool2d_backward.grad_input(dy, x, [k, k], [st, st], [p, p],
                                                              False, True, None, grad_input=tdx)

            r.run("pool.forward", "avg (global)", name, lambda: pool.forward(x, y, **kw),
                  t_fwd, nbytes=sx + sy, check=lambda: _rel(y, ty), torch_op="avg_pool2d")
            r.run("pool.backward", "avg", name, lambda: pool.backward(x, y, dy, dx, **kw),
                  t_bwd, nbytes=sy + sx, check=lambda: _rel(dx, tdx),
                  torch_op="avg_pool2d_backward")
        del x, dy, dx, tdx


def _bench_join(r, device, batch):
    shape = (batch, 256, 56, 56)
    a, b = _randn(shape, device, 7), _randn(shape, device, 8)
    y, ty = torch.empty_like(a), torch.empty_like(a)
    d0, d1 = torch.empty_like(a), torch.empty_like(a)
    s = a.numel() * 4
    r.run("join.add_forward", "2 inputs", _shape(shape), lambda: join.add_forward([a, b], y),
          lambda: torch.add(a, b, out=ty), nbytes=3 * s, check=lambda: _rel(y, ty))

    def t_copy2():
        d0.copy_(a)
        d1.copy_(a)

    def t_acc2():
        d0.add_(a)
        d1.add_(a)

    r.run("join.add_backward", "2 gradients, overwrite", _shape(shape),
          lambda: join.add_backward(a, [d0, d1], accumulate=False), t_copy2, nbytes=3 * s,
          torch_op="2x copy_ (torch autograd passes dy through without a copy)")
    r.run("join.add_backward", "2 gradients, accumulate", _shape(shape),
          lambda: join.add_backward(a, [d0, d1], accumulate=True), t_acc2, nbytes=5 * s,
          torch_op="2x add_")
    del a, b, y, ty, d0, d1

    cshape = (batch, 128, 28, 28)
    xs = [_randn(cshape, device, 9), _randn(cshape, device, 10)]
    oshape = (batch, 256, 28, 28)
    y, ty = torch.empty(oshape, device=device), torch.empty(oshape, device=device)
    dxs = [torch.empty(cshape, device=device) for _ in range(2)]
    s = y.numel() * 4
    r.run("join.concat_forward", "2 inputs", f"2x {_shape(cshape)}",
          lambda: join.concat_forward(xs, y), lambda: torch.cat(xs, dim=1, out=ty),
          nbytes=2 * s, check=lambda: _rel(y, ty))

    def t_split():
        dxs[0].copy_(y[:, :128])
        dxs[1].copy_(y[:, 128:])

    r.run("join.concat_backward", "2 gradients, overwrite", f"2x {_shape(cshape)}",
          lambda: join.concat_backward(y, dxs, accumulate=False), t_split, nbytes=2 * s,
          torch_op="2x slice copy_")


def _bench_lrn(r, device, batch):
    shape = (batch, 96, 55, 55)
    p = dict(size=5, alpha=1e-4, beta=0.75, k=2.0)
    x, dy = _randn(shape, device, 11) * 10, _randn(shape, device, 12)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    s = x.numel() * 4
    xg = x.clone().requires_grad_()
    out = F.local_response_norm(xg, **p)

    r.run("lrn.forward", "size 5", _shape(shape), lambda: lrn.forward(x, y, **p),
          lambda: F.local_response_norm(x, **p), nbytes=2 * s,
          check=lambda: _rel(y, F.local_response_norm(x, **p)),
          torch_op="F.local_response_norm (composite)")
    r.run("lrn.backward", "size 5 (recomputes from x)", _shape(shape),
          lambda: lrn.backward(x, dy, dx, **p),
          lambda: torch.autograd.grad(out, xg, dy, retain_graph=True), nbytes=3 * s,
          check=lambda: _rel(dx, torch.autograd.grad(out, xg, dy, retain_graph=True)[0]),
          torch_op="autograd.grad through F.local_response_norm", graph=False)


def bench(device="cuda", batch=32, only=GROUPS, log=print):
    """Run the benchmarks; returns one dict per (kernel, algo, shape)."""
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    r = common.Runner(log, _fmt,
                      graph_timer=common.do_bench_graph if device == "cuda" else None)
    r.copy_gbps = common.copy_gbps(device)
    log(f"torch copy_: {r.copy_gbps:.0f} GB/s")
    fns = {"bn": _bench_bn, "pool": _bench_pool, "join": _bench_join, "lrn": _bench_lrn}
    for grp in only:
        try:
            fns[grp](r, device, batch)
        except Exception as e:  # a group that fails to set up still leaves a row
            r.rows.append({"kernel": grp, "error": f"{type(e).__name__}: {e}"[:500]})
            log(f"{grp}: {r.rows[-1]['error']}")
        torch.cuda.empty_cache()
    return r.rows


def _fmt(row):
    if "error" in row:
        return (f"{row['kernel']:<22}{row.get('algo', ''):<34}{row.get('shape', ''):<30}"
                f" ERROR {row['error']}")
    return (f"{row['kernel']:<22}{row['algo'][:33]:<34}{row['shape'][:29]:<30}"
            f"{row['tinysn_ms']:>9.4f}{row['torch_ms']:>9.4f}{row['ratio']:>7.2f}"
            f"{row['gbps']:>8.0f}{row.get('frac_of_copy', 0):>6.2f}"
            + (f"  err {row['rel_err']:.1e}" if "rel_err" in row else "") + common.graph_note(row))


def main():
    common.group_main(bench, GROUPS, f"{'kernel':<22}{'algo':<34}{'shape':<30}"
                                     f"{'tinysn':>9}{'torch':>9}{'ratio':>7}{'GB/s':>8}{'/copy':>6}")


if __name__ == "__main__":
    main()
