"""A cold start's compilation, done at once: every kernel of a training step compiled on a
thread pool before the first step runs.

Cold (empty triton cache), compiling tinysn's kernels one by one is most of a first step:
ResNet-50 launches some hundred distinct (kernel, config, shape) variants. Triton compiles
with the GIL released, so `kernels/_common.compiling_in_parallel` compiles them side by side;
walking the plan inside it visits exactly the kernels (and autotuning configs) a step uses.
"""
import torch

from .kernels._common import INTERPRET, compiling_in_parallel


def compile_step(rt) -> None:
    """Compile every kernel of `rt`'s step: one walk of its plan in which no kernel runs
    (torch copies between the pool and the host do, on zeros), made before the parameters
    are set; the walk's statistics are dropped. Nothing to do under the interpreter."""
    if INTERPRET:
        return
    from .runtime import Stats

    images = torch.zeros((rt.net.batch, *rt.net.input_shape))
    with compiling_in_parallel():
        rt._walk(images, torch.zeros(rt.net.batch, dtype=torch.long))
    torch.cuda.synchronize(rt.device)
    rt.stats = Stats(conv_algos=rt.plan.conv_algos, device=rt.device)
