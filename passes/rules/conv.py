"""Rules for convolutions (conv1d/2d/3d and core ``convolution``; groups, depthwise,
stride, padding, dilation, transposed).

The convolution is multilinear in (input, weight): the boolean rule is the op itself run
on 0/1 masks (see :func:`common.multilinear`): an output element is pruned iff every
term (input × weight) of its window sum has a pruned factor; the bias keeps whole output
channels. Backward, an input element is needed iff it meets a kept weight on the way to a
needed output (a pruned filter prunes the input channels it alone reads; a pruned output
channel prunes its filter), and a weight element iff it meets a kept input.
"""

from __future__ import annotations

from ...graph import Op
from .matmul import affine_rule
from .registry import rule


@rule("conv1d", "conv2d", "conv3d", "convolution", "conv", "conv_transpose1d", "conv_transpose2d",
      "conv_transpose3d")
def conv(op: Op, ins, outs):
    if "input" not in op.roles or "weight" not in op.roles:
        return None
    x, w = op.roles.index("input"), op.roles.index("weight")
    b = op.roles.index("bias") if "bias" in op.roles else None
    channel_dim = 1 if len(ins[x].shape) == len(ins[w].shape) else 0  # batched or not

    def fn(xm, wm):
        env = {op.inputs[x]: xm, op.inputs[w]: wm}
        if b is not None:
            env[op.inputs[b]] = None
        return op.call(env)[0]

    return affine_rule(op, ins, outs, fn, [x, w], [b], channel_dim=channel_dim)
