"""The norm kernel's spec and torch references (TVM-free).

``kind="layer"``: ``Y[m, :] = (X[m, :] - mean) · rsqrt(var + eps) · G + B`` over the last dimension; ``kind="rms"``
(RMSNorm, as Hugging Face's Llama computes it): ``Y[m, :] = G · round(X[m, :] · rsqrt(mean(X²) + eps))``, fp16 (or
bf16: ``dtype``) in and out. ``out="int8"`` or ``"both"`` also (or only) emits the per-token int8 codes and scales
the W8A8 kernels read, bit for bit ``quant.spec.quantize_rows`` of the 16-bit ``Y``; ``residual=True`` normalises
``X + R``, and ``residual_out=True`` also writes that sum ``H`` (a pre-norm decoder's residual stream).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

OUTPUTS = ("fp16", "int8", "both")
KINDS = ("layer", "rms")


@dataclass(frozen=True)
class LayerNormSpec:
    m: int                      # 0: any number of rows (M a kernel argument)
    n: int                      # normalised width, a multiple of 8 (16-byte rows)
    eps: float = 1e-5
    affine: bool = True         # G (fp16 weight)
    bias: bool = True           # B (fp16 bias)
    out: str = "fp16"           # "fp16": Y; "int8": XQ, XS; "both"
    residual: bool = False      # normalise X + R (the fp16 sum, as torch's add): the residual add fused
    threads: int = 32           # threads per row: 32 = a warp per row, 64..1024 = a CTA per row
    dtype: str = "float16"      # X, R, G, B, Y: "float16" or "bfloat16"
    name: str = "layer_norm"
    kind: str = "layer"         # "layer": LayerNorm; "rms": RMSNorm (no mean, no bias)
    residual_out: bool = False  # also write H = X + R (the residual stream a pre-norm decoder reads on)

    def __post_init__(self):
        bad = []
        if self.m < 0 or self.n <= 0 or self.n % 8:
            bad.append(f"M must be positive or 0 (any number of rows), N positive and N={self.n} a multiple of 8")
        if self.threads not in (32, 64, 128, 256, 512, 1024):
            bad.append("threads must be a power of two from 32 to 1024")
        if self.out not in OUTPUTS:
            bad.append(f"out must be one of {OUTPUTS}")
        if not self.eps > 0:
            bad.append("eps must be positive")
        if self.dtype not in ("float16", "bfloat16"):
            bad.append(f"dtype {self.dtype!r} must be 'float16' or 'bfloat16'")
        if self.bias and not self.affine:
            bad.append("a bias needs the affine weight (torch's layer_norm takes either both or none)")
        if self.kind not in KINDS:
            bad.append(f"kind {self.kind!r} must be one of {KINDS}")
        if self.kind == "rms" and self.bias:
            bad.append("an RMSNorm has no bias")
        if self.residual_out and not self.residual:
            bad.append("residual_out writes X + R: it needs residual=True")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def rows_per_cta(self) -> int:
        return 4 if self.threads == 32 else 1

    @property
    def per_thread(self) -> int:
        """16-byte chunks each thread holds in registers."""
        return -(-(self.n // 8) // self.threads)

    def key(self) -> dict:
        d = asdict(self)
        for name, default in (("dtype", "float16"), ("kind", "layer"), ("residual_out", False)):
            if d[name] == default:      # a LayerNorm's key stays what it was before the field existed
                del d[name]
        return d


def argument_names(spec: LayerNormSpec) -> list[str]:
    names = ["X"] + ["R"] * spec.residual + ["G"] * spec.affine + ["B"] * spec.bias
    return names + ["Y"] * (spec.out != "int8") + ["H"] * spec.residual_out + ["XQ", "XS"] * (spec.out != "fp16")


def pick_threads(n: int) -> int:
    """Threads per row for width ``n``: a warp while each lane holds at most 32 values (OneFlow's
    warp kernel up to 1024 columns), else enough threads for 16 values each, up to 1024."""
    if n <= 1024:
        return 32
    return min(1024, max(64, 1 << (-(-n // 16) - 1).bit_length()))


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The fp32 LayerNorm of 16-bit ``x`` over its last dimension, rounded to ``x``'s dtype."""
    return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], None if weight is None else weight.float(),
                                          None if bias is None else bias.float(), eps).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm of 16-bit ``x``: the statistics and the scaling in fp32, rounded to ``x``'s dtype,
    then times the weight in that dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight.to(x.dtype) * y
