"""sparta on the command line: compile an ONNX model with TeSAs from a file, read a saved model's plan, profile it.

    sparta compile model.onnx --tesa masks.safetensors --target cuda -o out/
    sparta inspect out/                 # the plan and the kernels, from the folder alone (nothing is loaded or run)
    sparta profile out/ --device cuda   # one forward on random inputs, op by op against the dense reference

A TeSA file is safetensors (tensor name → a bool mask, true = kept, or uint8 bit widths, 0 = pruned) or JSON (tensor
name → ``TeSA.to_json()``). TeSAs written into the ONNX file by ``sparta.to_onnx`` come with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .errors import SpartaError

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "bool": torch.bool}


def read_tesas(path) -> dict:
    """Tensor name → TeSA from a ``.safetensors`` or ``.json`` file."""
    from .tesa import TeSA
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise SpartaError(f"cannot read TeSAs from {path}: {exc}") from exc
        out = {}
        for name, t in tensors.items():
            if t.dtype == torch.bool:
                out[name] = TeSA.from_mask(t)
            elif t.dtype == torch.uint8:
                out[name] = TeSA.from_bits(t)
            else:
                raise SpartaError(f"{path}: tensor {name!r} is {t.dtype}; a TeSA file holds bool masks (true = kept) "
                                  "or uint8 bit widths (0 = pruned)")
        return out
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SpartaError(f"cannot read TeSAs from {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise SpartaError(f"{path}: a TeSA file maps tensor names to TeSAs (a JSON object)")
        return {str(name): TeSA.from_json(value) for name, value in data.items()}
    raise SpartaError(f"{path}: TeSA files are .safetensors or .json")


def example_input(spec: str) -> torch.Tensor:
    """``"2x128:int64"`` → a tensor of that shape and dtype (integers 0 or 1, floats random)."""
    shape_text, _, dtype_text = spec.partition(":")
    dtype = DTYPES.get(dtype_text or "float32")
    try:
        shape = tuple(int(s) for s in shape_text.lower().split("x"))
    except ValueError:
        shape = ()
    if dtype is None or not shape or min(shape) < 1:
        raise SpartaError(f"--input {spec!r}: give a shape and dtype such as 2x128:int64 ({', '.join(DTYPES)})")
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 2, shape).to(dtype)


def cmd_compile(args) -> int:
    import sparta
    tesa = read_tesas(args.tesa) if args.tesa else {}
    inputs = tuple(example_input(s) for s in args.input)
    compiled = sparta.compile(args.model, tesa, inputs, target=args.target, verify=args.verify)
    path = compiled.save(args.output)
    print(compiled.plan_report(only_gemm=not args.all_ops))
    print(f"saved to {path}")
    return 0


def cmd_inspect(args) -> int:
    from .passes.transform.plan import Plan
    from .compiled_model import kernel_table
    from .saved_checks import MANIFEST, SavedModelError, read_manifest
    manifest = read_manifest(args.path)
    print(f"{args.path}: sparta {manifest.get('sparta', '?')}, target {manifest['target']}, torch "
          f"{manifest.get('torch', '?')}")
    plan, kernels = manifest.get("plan"), manifest.get("kernels") or []
    try:
        print(Plan.from_json(plan).report(only_gemm=not args.all_ops) if plan is not None else "no plan")
        if kernels:
            print(kernel_table(kernels))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise SavedModelError(f"{args.path}: the plan or kernel report in {MANIFEST} is malformed "
                              f"({type(exc).__name__}: {exc}); save the model again") from exc
    return 0


def cmd_profile(args) -> int:
    import sparta
    device = profile_device(args.device)
    compiled = sparta.load(args.path, trust_kernels=args.trust_kernels)
    if device is not None:
        compiled = compiled.to(device)
    prof = compiled.profile(reps=args.reps)
    print(prof.report(top=args.top))
    if args.json:
        path = Path(args.json)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(prof.to_json(), indent=1))
        except OSError as exc:
            raise SpartaError(f"--json {args.json}: cannot write the profile there ({exc}); give a file path in a "
                              "folder you can write") from exc
    return 0


def profile_device(text: str | None) -> torch.device | None:
    """The device ``--device`` names, checked to exist on this machine (None: where the model loads)."""
    if not text:
        return None
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise SpartaError(f"--device {text!r} is not a device; give cpu or cuda (cuda:1 for another GPU)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpartaError(f"--device {text}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                          "leave out --device to profile on the CPU, or run on a machine with a GPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SpartaError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise SpartaError(f"--device {text}: sparta runs on cpu or cuda")
    return device


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparta", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile an ONNX model and save it")
    c.add_argument("model", help="an .onnx file")
    c.add_argument("-o", "--output", required=True, help="the folder to save the compiled model to")
    c.add_argument("--tesa", help="TeSAs: .safetensors (bool masks or uint8 bits) or .json (TeSA.to_json by name)")
    c.add_argument("--target", default="cpu", choices=("cpu", "cuda"))
    c.add_argument("--input", action="append", default=[], metavar="SHAPE:DTYPE",
                   help="an example input, e.g. 2x128:int64 (one per model input, in order; for dynamic dimensions)")
    c.add_argument("--verify", action="store_true", help="check the kernels against the dense model (CPU target)")
    c.add_argument("--all-ops", action="store_true", help="report every op, not only the GEMMs")
    c.set_defaults(run=cmd_compile)
    i = sub.add_parser("inspect", help="print a saved model's plan and kernels (nothing is loaded or run)")
    i.add_argument("path")
    i.add_argument("--all-ops", action="store_true")
    i.set_defaults(run=cmd_inspect)
    p = sub.add_parser("profile", help="time a saved model op by op against its dense reference")
    p.add_argument("path")
    p.add_argument("--device", help="move the model there first (e.g. cuda)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=20, help="ops to list (the slowest first)")
    p.add_argument("--json", help="also write the profile to this file")
    p.add_argument("--trust-kernels", action="store_true",
                   help="load a CPU model's compiled libraries from the folder instead of rebuilding them")
    p.set_defaults(run=cmd_profile)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except SpartaError as exc:
        print(f"sparta {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
