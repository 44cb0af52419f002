"""flashrt.ops: one home for kernels. Each op's forms (the reference, CPU forms, the CUDA custom op,
the portable form an export records), the one load-time choice between them (`select`), and the native
libraries that hold the CPU and CUDA kernels (`library`: one builder; `csrc`, `csrc_cpu`, `torch_cpu`:
the CUDA kernels, the C CPU kernels, the CPU torch ops; `native`: the trust rules of a cache folder).

    from flashrt import ops
    choices = ops.select(model, device, dtype)       # {"rms_norm": {"fused": 37}, "geglu": {...}, ...}

The floor under `flashrt.nn`, `flashrt.quant` and `flashrt.runtime` (beside `flashrt.io`): it imports
none of them and knows no block and no model (`flashrt.ops.op` explains the mechanism).
"""

from __future__ import annotations

from flashrt.ops.op import (
                            Choices,
                            Form,
                            Op,
                            OpSlot,
                            choices,
                            export_ops,
                            export_translations,
                            get,
                            portable_forms,
                            register,
                            registered,
                            select,
                            slots,
                            using,
)

__all__ = ["Choices", "Form", "Op", "OpSlot", "choices", "export_ops", "export_translations", "get",
           "portable_forms", "register", "registered", "select", "slots", "using"]
