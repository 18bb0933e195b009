"""Static cost of a MIL program: multiply-adds of one call, from its static shapes.

Dev-only (tools/bench/count_decoder_macs.py compares the exported decoder step with the design that
recomputes cross K/V per step; tools/bench/bench_encoder_buckets.py counts each encoder bucket; the
decoder tests check the counter against both); the product never counts MACs.
"""

from __future__ import annotations

import numpy as np


def count_macs(mil_program, function_name: str = "main") -> dict:
    """Multiply-adds of one call of a MIL program, from its static shapes.

    Counted: `linear` (rows x in x out), `matmul` (batch x M x K x N), `conv` (output elements x
    in-channels/groups x kernel). Element-wise ops, softmax and norms are not multiply-adds of
    weights and are left out (they are O(width) per token). Returns totals by op type and the
    largest ops.
    """
    fn = mil_program.functions[function_name]
    by_type: dict[str, int] = {}
    ops = []

    def shape(var):
        return tuple(int(d) for d in var.shape)

    def walk(block):
        for op in block.operations:
            for inner in getattr(op, "blocks", []):
                walk(inner)
            macs = 0
            if op.op_type == "linear":
                x, w = shape(op.x), shape(op.weight)
                macs = int(np.prod(x[:-1])) * w[0] * w[1]
            elif op.op_type == "matmul":
                x, y = list(shape(op.x)), list(shape(op.y))
                if op.transpose_x is not None and bool(op.transpose_x.val):
                    x[-1], x[-2] = x[-2], x[-1]
                if op.transpose_y is not None and bool(op.transpose_y.val):
                    y[-1], y[-2] = y[-2], y[-1]
                out = shape(op.outputs[0])
                macs = int(np.prod(out)) * x[-1]
            elif op.op_type == "conv":
                w = shape(op.weight)  # (Cout, Cin/groups, k...)
                macs = int(np.prod(shape(op.outputs[0]))) * int(np.prod(w[1:]))
            if macs:
                by_type[op.op_type] = by_type.get(op.op_type, 0) + macs
                ops.append((macs, op.op_type, op.name))

    walk(fn)
    ops.sort(reverse=True)
    return {"total": int(sum(by_type.values())), "by_type": by_type, "largest": ops[:8]}
