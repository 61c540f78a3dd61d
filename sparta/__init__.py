"""sparta: a sparsity-and-quantization compiler for deep-learning models (after SparTA, OSDI'22).

Attach a TeSA (tensor with sparsity attribute) to a model's tensors, propagate it,
plan sub-operators that hardware runs well, and run kernels specialised to the exact
sparsity. See README.md and docs/.
"""

from .compiled_model import CompiledModel, VerificationError
from .compiler import attach_tesa, compile, load  # noqa: A004
from .errors import (CaptureError, CodegenError, GraphError, PlanError, PropagationError, SpartaError,
                     TeSAError)
from .frontend import capture, from_onnx, from_torch, to_onnx
from .graph import Graph, Op, Value
from .saved import SavedModelError
from .tesa import TeSA

__version__ = "0.1.0"

__all__ = ["TeSA", "Graph", "Op", "Value", "capture", "from_torch", "from_onnx", "to_onnx", "compile",
           "load", "SavedModelError", "attach_tesa", "CompiledModel", "SpartaError", "TeSAError", "CaptureError", "GraphError",
           "PlanError", "PropagationError", "CodegenError", "VerificationError"]
