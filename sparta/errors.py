"""Every user-facing error sparta raises derives from :class:`SpartaError`."""


class SpartaError(Exception):
    """Base class of all sparta errors."""


class TeSAError(SpartaError, ValueError):
    """A TeSA is malformed or does not fit the tensor it is attached to."""


class CaptureError(SpartaError):
    """A model could not be turned into a sparta graph."""


class GraphError(SpartaError, KeyError):
    """A name or structure in the graph is wrong (unknown tensor, bad edge)."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class PropagationError(SpartaError):
    """A propagation rule broke the lattice contract or failed."""


class PlanError(SpartaError):
    """An execution plan is invalid or cannot be built."""


class CodegenError(SpartaError):
    """A kernel could not be generated, built or loaded."""


class QuantizationError(SpartaError):
    """Bad calibration input or quantization configuration."""


class ArgumentTypeError(SpartaError, TypeError):
    """An argument of the wrong type; the message says what to pass."""
