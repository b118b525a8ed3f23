"""The output folder of `balancer pack`: its names, for the ownership rules of `balancer.data.shards.output` (a file is
ours only when a pack manifest or state in the folder names it, or it is metadata this tool wrote; `--overwrite`
never deletes the user's files)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from balancer.data.shards.output import OutputKind, clear_outputs, is_output_name, prepare_output

PACK_FORMAT = "balancer-packed"
PACK_FORMAT_VERSION = 1
PACK_STATE_NAME = ".pack-state.json"
PACK_DESCRIPTION = "balancer pack output: one packed micro-batch per row, ordered (epoch, step, micro-batch, DP rank)"
# shards, plans, and the temporary files Plan.save writes beside a plan (`.plan-epoch-00000.json.tmp.<random>.tmp`)
_PACK_FILE_RE = re.compile(r"^(shard-\d{5,}\.arrow|plan-epoch-\d{5,}\.json|\.plan-epoch-\d{5,}\.json(\.tmp)?\.\w+)$")
PACK = OutputKind("pack", PACK_FORMAT, PACK_STATE_NAME, _PACK_FILE_RE, PACK_DESCRIPTION, ("plans", "shards"))


def is_pack_name(name: str) -> bool:
    """A name `balancer pack` may write into its output folder (final or temporary)."""
    return is_output_name(name, PACK)


def clear_owned(out: Path, owned: set[str], keep: set[str]) -> None:
    """Remove the files of ours (`owned`) in `out` except `keep`."""
    clear_outputs(out, owned, keep, PACK)


def prepare_pack_output(out: Path, job: str, overwrite: bool) -> tuple[str, Optional[dict], set[str]]:
    """('fresh'|'resume'|'complete', state or manifest, owned names) for writing job `job` into the (existing)
    folder `out`."""
    return prepare_output(out, job, None, overwrite, PACK)
