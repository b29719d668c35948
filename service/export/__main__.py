"""``nca-export MODEL --onnx FILE``: write a trained model's map as an ONNX graph.

    nca-export models/digits --onnx digits.onnx
    python -m onnxruntime ...   # or any ONNX runtime: input x (batch, D), output z (batch, d)

Exit 0 with one line naming the file; exit 2 with one line naming what was wrong (an
artifact that does not read, an --onnx path that exists or is empty, a missing folder, a full
disk). The file written has the mode a new file gets (0666 less the umask), or the mode of
the file it replaces.
"""

from __future__ import annotations

import argparse
import os
import sys

from service.core.artifact import ArtifactError
from service.export.onnx_map import export_artifact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nca-export",
        description="Write a trained model's learned map (standardisation and projection) "
        "as an ONNX graph: input x (batch, D) float32, output z (batch, d) float32, what "
        "/v1/embed answers.",
    )
    parser.add_argument("model", help="an artifact directory written by python -m training")
    parser.add_argument("--onnx", required=True, metavar="FILE", help="the .onnx file to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace FILE when it exists (a regular file)"
    )
    args = parser.parse_args(argv)
    try:
        written = export_artifact(args.model, args.onnx, overwrite=args.overwrite)
    except (ArtifactError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        print(f"error: cannot write {args.onnx}: {reason}; nothing written", file=sys.stderr)
        return 2
    print(f"wrote {written} (input x: (batch, D) float32, output z: (batch, d) float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
