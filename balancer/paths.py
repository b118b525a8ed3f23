"""How an output path relates to a command's inputs: the one rule behind every command's refusal to overwrite
what it reads (`balancer.data.output_paths.check_output_file` for single files, `refuse_overwrite_of_inputs` in
`balancer.data.shards.output` for output folders). Imports nothing of balancer, so both layers use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def input_clash(
    output_path: str | os.PathLike, input_paths: Iterable[str | os.PathLike | None]
) -> tuple[str, str | os.PathLike] | None:
    """How writing `output_path` (a file or a folder, existing or not) would touch one of `input_paths`, as
    (how, input): "is" (the same path after symlinks, or the same file through a hard link), "inside" (it lies in
    an input folder) or "contains" (it is a folder holding an input); None when it touches none. Inputs that do
    not exist (a built-in trace or hub dataset name) are skipped. The one rule behind every command's output
    check; each surface words the refusal itself (`check_output_file`, `refuse_overwrite_of_inputs`)."""
    real_out = os.path.realpath(output_path)
    for spec in input_paths:
        if spec is None or not os.path.lexists(spec):
            continue
        real_in = os.path.realpath(spec)
        if real_in == real_out or (os.path.exists(output_path) and os.path.exists(spec)
                                   and os.path.samefile(output_path, spec)):  # fmt: skip
            return "is", spec
        if os.path.isdir(real_in) and _inside(real_out, real_in):
            return "inside", spec
        if _inside(real_in, real_out):
            return "contains", spec
    return None
