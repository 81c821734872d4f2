"""What the compiler makes of the kernels, without a GPU: each kernel a launcher runs on
VGG16's shapes (ResNet-50's and AlexNet's where VGG16 has none of the kind), compiled for the
H200 (sm_90) on this machine, every config of an autotuned kernel: registers per thread,
local memory (spills), shared memory, and its global memory and matrix instructions (vector
width of the loads and stores, TMA, wgmma).

    PYTHONPATH=. python bench/sass.py [--only CASE,...] [--batch 16] [--out PATH]

How: the launchers run on CPU tensors with Triton's JIT in place of the interpreter and its
launch captured (`JITFunction.run`), so each call's arguments are the real ones; each is then
specialized as Triton's JIT would on a GPU (16-byte alignment of pointers, integers
divisible by 16) and compiled for sm_90 through ptxas, which the triton wheel carries; the
report reads the cubin with cuobjdump. It uses this machine's triton (CI's 3.9; the device
machine runs 3.6, whose code generation may differ), so it finds spills, lost vector
widths or shared memory past the H200's 227 KiB before a GPU call, not times. To compile
with the device's triton, put its wheel first on the path (`pip install --no-deps --target
DIR triton==3.6.0`, then `PYTHONPATH=DIR:. python3 bench/sass.py`): what 3.6's front end
refuses (a kernel 3.9 compiles) fails here as it would on the GPU.
Run it as its own process: it must import triton before tinysn picks the interpreter.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"      # before triton: real JIT functions to compile
os.environ["TINYSN_AUTOTUNE"] = "0"       # one config per launch; the report compiles all
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from bench import common  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the instruction kinds the report lists (SASS opcodes, modifiers kept: LDG.E.128 is a
# 16-byte load per thread, LDG.E a 4-byte one)
_OPCODES = ("LDG", "STG", "UTMALDG", "UTMASTG", "HGMMA", "HMMA", "LDGSTS", "RED", "ATOM")
# a line of cuobjdump's SASS listing that holds an instruction: "        /*0a40*/   IMAD ..."
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+\S")


def cases(batch: int) -> dict:
    """name -> a call of a tinysn launcher on VGG16's shapes (CPU tensors, batch `batch`)."""
    from tinysn.kernels import bn, conv, join, linear, lrn, pool, sgd

    def t(*shape):
        return torch.randn(*shape)

    def ws(nbytes):
        return torch.empty(max(nbytes, 4), dtype=torch.uint8)

    def conv_case(phase, algo, c, hw, k, stride=1, accumulate=False, bias=False):
        def call():     # tensors made when the case runs, as for the other cases
            x, w = t(batch, c, hw, hw), t(k, c, 3, 3)
            dy = t(*conv.out_shape(x.shape, w.shape, stride, 1))
            need = conv.workspace_bytes(x.shape, w.shape, stride, 1, phase, algo)
            kw = dict(stride=stride, padding=1, algo=algo, workspace=ws(need))
            if phase == "forward":
                conv.forward(x, w, t(k), torch.empty(dy.shape), relu=True, **kw)
            elif phase == "backward_data":      # accumulating: the data gradient of a fan-out
                conv.backward_data(dy, w, t(*x.shape), relu_output=x, accumulate=accumulate,
                                   **kw)
            else:
                conv.backward_weight(x, dy, torch.empty(w.shape), t(k) if bias else None,
                                     **kw)
        return call

    n = batch
    return {
        "conv fwd nhwc 256@56": conv_case("forward", "nhwc", 256, 56, 256),
        "conv fwd implicit 512@14": conv_case("forward", "implicit", 512, 14, 512),
        "conv fwd splitk 512@7": conv_case("forward", "splitk", 512, 7, 512),   # ResNet-50's
        "conv dgrad flipped_splitk+ 512@7": conv_case("backward_data", "flipped_splitk", 512,
                                                      7, 512, accumulate=True),
        "conv dgrad flipped_nhwc 256@56": conv_case("backward_data", "flipped_nhwc", 256, 56,
                                                    256),
        "conv dgrad flipped+ 512@14": conv_case("backward_data", "flipped", 512, 14, 512,
                                                accumulate=True),
        "conv dgrad flipped_nhwc+ 256@56": conv_case("backward_data", "flipped_nhwc", 256, 56,
                                                     256, accumulate=True),
        "conv dgrad implicit 3x3/2 128@56": conv_case("backward_data", "implicit", 128, 56,
                                                      128, stride=2),
        "conv dgrad implicit+ 3x3/2 128@56": conv_case("backward_data", "implicit", 128, 56,
                                                       128, stride=2, accumulate=True),
        "conv dgrad transposed 3x3/2 128@56": conv_case("backward_data", "transposed", 128,
                                                        56, 128, stride=2),
        "conv dgrad transposed+ 3x3/2 128@56": conv_case("backward_data", "transposed", 128,
                                                         56, 128, stride=2, accumulate=True),
        "conv wgrad tma 256@56": conv_case("backward_weight", "tma", 256, 56, 256),
        "conv wgrad splitk 128@112": conv_case("backward_weight", "splitk", 128, 112, 128),
        # VGG16's conv1_1: the bias gradient summed in the GEMM (partial sums per chunk)
        "conv wgrad splitk+db 3->64@224": conv_case("backward_weight", "splitk", 3, 224, 64,
                                                    bias=True),
        "conv wgrad nhwc 64@224": conv_case("backward_weight", "nhwc", 64, 224, 64),
        "bias grad 64@224": lambda: conv.backward_weight(t(n, 64, 224, 224),
                                                         t(n, 64, 224, 224), None, t(64),
                                                         stride=1, padding=1),
        "pool 2x2/2 fwd": lambda: pool.forward(t(n, 64, 224, 224), torch.empty(n, 64, 112, 112),
                                               mode="max", kernel=2, stride=2, padding=0),
        "pool 2x2/2 bwd": lambda: pool.backward(
            t(n, 64, 224, 224), t(n, 64, 112, 112), t(n, 64, 112, 112),
            torch.empty(n, 64, 224, 224), mode="max", kernel=2, stride=2, padding=0),
        "pool 3x3/2 bwd": lambda: pool.backward(      # each cell finds its windows' argmax
            t(n, 64, 112, 112), None, t(n, 64, 56, 56), torch.empty(n, 64, 112, 112),
            mode="max", kernel=3, stride=2, padding=1),
        "pool 3x3/2 bwd argmax": lambda: pool.backward(
            t(n, 64, 112, 112), t(n, 64, 56, 56), t(n, 64, 56, 56), torch.empty(n, 64, 112, 112),
            mode="max", kernel=3, stride=2, padding=1, workspace=ws(pool.argmax_workspace_bytes(
                (n, 64, 112, 112), mode="max", kernel=3, stride=2, padding=1))),
        "pool 3x3/2 bwd stored argmax relu": lambda: pool.backward(   # as a plan runs it
            None, None, t(n, 64, 56, 56), torch.empty(n, 64, 112, 112), mode="max", kernel=3,
            stride=2, padding=1, argmax=torch.zeros(n, 64, 56, 56, dtype=torch.uint8),
            x_is_relu_output=True),
        "pool 2x2/2 bwd stored argmax relu": lambda: pool.backward(
            None, None, t(n, 64, 112, 112), torch.empty(n, 64, 224, 224), mode="max",
            kernel=2, stride=2, padding=0,
            argmax=torch.zeros(n, 64, 112, 112, dtype=torch.uint8), x_is_relu_output=True),
        "lrn fwd": lambda: lrn.forward(t(n, 96, 55, 55), torch.empty(n, 96, 55, 55), size=5,
                                       alpha=1e-4, beta=0.75, k=2.0),
        "lrn bwd": lambda: lrn.backward(t(n, 96, 55, 55), t(n, 96, 55, 55),
                                        torch.empty(n, 96, 55, 55), size=5, alpha=1e-4,
                                        beta=0.75, k=2.0),
        "add fwd / bwd": lambda: (join.add_forward([t(n, 256, 56, 56), t(n, 256, 56, 56)],
                                                   torch.empty(n, 256, 56, 56)),
                                  join.add_backward(t(n, 256, 56, 56),
                                                    [torch.empty(n, 256, 56, 56),
                                                     torch.empty(n, 256, 56, 56)])),
        "concat fwd / bwd": lambda: (join.concat_forward([t(n, 128, 28, 28), t(n, 128, 28, 28)],
                                                         torch.empty(n, 256, 28, 28)),
                                     join.concat_backward(t(n, 256, 28, 28),
                                                          [torch.empty(n, 128, 28, 28),
                                                           torch.empty(n, 128, 28, 28)])),
        "bn fwd relu 64@112": lambda: bn.forward(     # ResNet-50's first, its ReLU fused
            t(n, 64, 112, 112), t(64), t(64), torch.empty(n, 64, 112, 112), t(64), t(64),
            torch.empty(2, 64), ws(bn.workspace_bytes((n, 64, 112, 112), "forward")),
            relu=True),
        "bn fwd residual 256@56": lambda: bn.forward(   # a block's last, its add fused in
            t(n, 256, 56, 56), t(256), t(256), torch.empty(n, 256, 56, 56), t(256), t(256),
            torch.empty(2, 256), ws(bn.workspace_bytes((n, 256, 56, 56), "forward")),
            relu=True, residual=t(n, 256, 56, 56), skip=torch.zeros(1)),
        "bn bwd 256@56": lambda: bn.backward(
            t(n, 256, 56, 56), t(256), t(n, 256, 56, 56), t(2, 256),
            torch.empty(n, 256, 56, 56), torch.empty(256), torch.empty(256),
            ws(bn.workspace_bytes((n, 256, 56, 56), "backward"))),
        "bn bwd 64@56": lambda: bn.backward(   # 64 channels: three launches at any batch
            t(n, 64, 56, 56), t(64), t(n, 64, 56, 56), t(2, 64), torch.empty(n, 64, 56, 56),
            torch.empty(64), torch.empty(64), ws(bn.workspace_bytes((n, 64, 56, 56), "backward"))),
        "bn bwd residual 256@56": lambda: bn.backward(   # the residual's gradient stored too
            t(n, 256, 56, 56), t(256), t(n, 256, 56, 56), t(2, 256),
            torch.empty(n, 256, 56, 56), torch.empty(256), torch.empty(256),
            ws(bn.workspace_bytes((n, 256, 56, 56), "backward")),
            relu_output=t(n, 256, 56, 56), dy_out=torch.empty(n, 256, 56, 56)),
        "bn bwd params 2048@7": lambda: bn.backward(     # no dx: the merge pass alone
            t(n, 2048, 7, 7), t(2048), t(n, 2048, 7, 7), t(2, 2048), None,
            torch.empty(2048), torch.empty(2048),
            ws(bn.workspace_bytes((n, 2048, 7, 7), "backward"))),
        "bn fwd 2048@7": lambda: bn.forward(             # many channels per merge tile
            t(n, 2048, 7, 7), t(2048), t(2048), torch.empty(n, 2048, 7, 7), t(2048), t(2048),
            torch.empty(2, 2048), ws(bn.workspace_bytes((n, 2048, 7, 7), "forward"))),
        "bn rebuild 2048@7": lambda: bn.rebuild(
            t(n, 2048, 7, 7), t(2048), t(2048), torch.empty(n, 2048, 7, 7), t(2, 2048)),
        # a conv's weight and a batch norm's, the rate in memory as the Runtime passes it
        "sgd 3 tensors": lambda: sgd.update_many(
            [(t(589824), t(589824), t(589824)), (t(256), t(256), t(256)),
             (t(256), t(256), t(256))], lr=torch.full((1,), 0.01), momentum=0.9,
            weight_decay=5e-4, skip=torch.zeros(1)),
        "fc6 fwd": lambda: linear.forward(t(n, 25088), t(4096, 25088), t(4096),
                                          torch.empty(n, 4096)),
        "fc6 wgrad": lambda: linear.backward(t(n, 25088), None, t(n, 4096), None,
                                             torch.empty(4096, 25088), torch.empty(4096)),
        "fc6 wgrad+sgd": lambda: linear.backward(      # the weight's step in the epilogue
            t(n, 25088), t(4096, 25088), t(n, 4096), None, None, torch.empty(4096),
            update=sgd.Update(t(4096, 25088), torch.full((1,), 0.01), 0.9, 5e-4,
                              torch.zeros(1))),
        "sgd 1M": lambda: sgd.update(t(1 << 20), t(1 << 20), t(1 << 20), lr=0.01,
                                     momentum=0.9, weight_decay=5e-4),
    }


def capture(call) -> list:
    """[(JITFunction, args, kwargs)] of every kernel launch `call` makes, none run."""
    calls = []
    real_run = JITFunction.run

    def record(self, *args, grid, warmup=False, **kwargs):
        calls.append((self, args, kwargs))
    JITFunction.run = record
    try:
        call()
    finally:
        JITFunction.run = real_run
    return calls


def _tuners() -> dict:
    """id(JITFunction) -> its Autotuner, over tinysn's kernel modules (through a
    triton.heuristics wrapper between them, where there is one)."""
    import importlib
    import pkgutil
    import tinysn.kernels as pkg
    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"tinysn.kernels.{info.name}")
        for v in vars(module).values():
            if isinstance(v, Autotuner):
                inner = v.fn
                while not isinstance(inner, JITFunction):
                    inner = inner.fn
                found[id(inner)] = v
    return found


def variants(fn, args, kwargs, tuner) -> list:
    """[(config text, args, kwargs)]: the call itself, or one per GPU config of its tuner
    (descriptor boxes set by the tuner's config hook)."""
    if tuner is None:
        return [("", args, kwargs)]
    from tinysn.kernels import _common
    heuristics = getattr(tuner.fn, "values", {})       # triton.heuristics: name -> rule
    meta = set(tuner.configs[0].all_kwargs()) | set(heuristics)
    base = {k: v for k, v in kwargs.items() if k not in meta}
    out = []
    for cfg in tuner.all_configs:
        kw = {**base, **cfg.all_kwargs()}
        named = {**dict(zip(tuner.arg_names, args)), **kw}
        kw.update({name: rule(named) for name, rule in heuristics.items()})
        out.append((str(cfg), _common._hooked(tuner, args, base, cfg), kw))
    return out


def compile_sm90(fn, args, kwargs):
    """The call specialized as Triton's JIT would for these arguments, compiled for sm_90."""
    backend = CUDABackend(TARGET)
    kwargs = {"debug": False, **kwargs}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def resources(compiled) -> dict:
    """Registers, local (spill) and shared bytes, and the memory and matrix opcodes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage",
                                f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", usage))
    ops = sorted({word for line in sass.splitlines() for word in line.split()
                  if word.startswith(_OPCODES)})
    instructions = sum(1 for line in sass.splitlines() if _INSTRUCTION.match(line))
    return {"registers": int(fields.get("REG", 0)), "local_bytes": int(fields.get("LOCAL", 0)),
            "instructions": instructions,
            "stack_bytes": int(fields.get("STACK", 0)),
            "shared_bytes": int(compiled.metadata.shared), "opcodes": ops,
            "wgmma_a": wgmma_a_source(sass)}


def wgmma_a_source(sass: str):
    """Where the kernel's wgmma (HGMMA) instructions take their A operand: "shared" (a
    shared-memory descriptor, as for B), "registers" (loaded from shared memory by the
    threads first: more registers, and the MMA waits on those loads), both, or None."""
    sources = set()
    for line in sass.splitlines():
        if "HGMMA" in line:      # HGMMA.<shape>.<types> D, A, B, C: A is gdesc[...] or Rn
            operands = line.split("HGMMA", 1)[1].split(";")[0].split(",")
            if len(operands) > 1:
                sources.add("shared" if "gdesc" in operands[1] else "registers")
    return "+".join(sorted(sources)) or None


def report(names, batch: int) -> list:
    """One row per (case, kernel, config)."""
    tuners, rows = _tuners(), []
    for name, call in cases(batch).items():
        if names and name not in names:
            continue
        for fn, args, kwargs in capture(call):
            for config, a, kw in variants(fn, args, kwargs, tuners.get(id(fn))):
                row = {"case": name, "kernel": fn.__name__, "config": config,
                       "num_warps": kw.get("num_warps", 4)}
                row.update(resources(compile_sm90(fn, a, kw)))
                rows.append(row)
                source = f"wgmma A {row['wgmma_a']} " if row["wgmma_a"] else ""
                print(f"{name:32s} {fn.__name__:32s} w{row['num_warps']} "
                      f"reg {row['registers']:3d} local {row['local_bytes']:4d} "
                      f"instr {row['instructions']:5d} "
                      f"smem {row['shared_bytes']:6d} {source}{' '.join(row['opcodes'])}  "
                      f"{config}",
                      flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--batch", type=int, default=16)
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(cases(1)))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; cases: {sorted(cases(1))}")
    rows = report(names, args.batch)
    common.write(args.out, {"target": "sm_90", "triton": triton.__version__,
                            "batch": args.batch, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
