"""The documented range of every count a user gives, on the CLI and in the API, and the one wording of a count out
of range. The single owner of these numbers: `balancer.cli.flags` checks the command-line flags against them and
`balancer.data.shards.limits` the data commands' arguments; this module imports nothing, so both (and `--help`)
read it without loading anything else.
"""

from __future__ import annotations

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# the planning topology and its flags (plan, stats, demo, pack, calibrate)
MAX_RANKS = 2**20  # dp, cp, pp, micro_batches, each --cp-sizes entry (pack: one row per micro-batch and DP rank)
MAX_TOKENS = 2**40  # max_tokens, window, split_threshold: far beyond any context length
MAX_STEP_TOKENS = 2**62  # tokens_per_step, window_docs, window_index
MAX_SEED = INT64_MAX  # seeds and epochs of the shuffle
# a cost coefficient (--attn-coef, --linear-coef, --fixed, a cost file's): far above any FLOP count per pair or
# token, and low enough that an epoch's costs (up to ~2^120 pairs per micro-batch, summed over steps) stay finite
MAX_COEFFICIENT = 1e100

# the data commands (pretokenize, merge, pack)
MAX_LENGTH = 2**31 - 1  # tokens in one row: Arrow list offsets are int32
MAX_SHARD_TOKENS = 2**40  # tokens per shard (~2 TB of uint16 ids)
DEFAULT_SHARD_TOKENS = 100_000_000  # a shard closes after this many tokens (~200 MB of uint16 ids)
MAX_NUM_PROC = 1024  # worker processes (clipped further to the CPUs and the records)
MAX_NUM_SHARDS = 2**20  # --num-shards slices
MAX_EPOCHS = 10_000  # pack --epochs
MAX_PACK_SEED = MAX_SEED - MAX_EPOCHS  # pack --seed: epoch e < MAX_EPOCHS plans with seed + e, an int64


def bound_text(x: int | float) -> str:
    """A range bound as `--help` and the errors show it: 2^20, 2^40, 2^62, 2^63-1, else 1,024."""
    for power in (62, 40, 20):
        if x == 2**power:
            return f"2^{power}"
    return "2^63-1" if x == INT64_MAX else f"{x:,}" if isinstance(x, int) else str(x)


def shown(value: object) -> str:
    """A value as an error quotes it: a huge number shortened to its first digits and its length."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def out_of_range(value: object, low: int, high: int) -> str:
    """What is wrong with a count out of range: `must be in [LOW, HIGH], got VALUE`."""
    return f"must be in [{bound_text(low)}, {bound_text(high)}], got {shown(value)}"


def range_error(name: str, value: object, low: int, high: int) -> str:
    """The one line for a count out of range: `NAME must be in [LOW, HIGH], got VALUE`."""
    return f"{name} {out_of_range(value, low, high)}"


def check_int(name: str, value: object, low: int = 0, high: int = INT64_MAX) -> int:
    """`value` as an int in [low, high], or a ValueError naming `name`: booleans, floats (also `3.0`), strings and
    NaN are refused; NumPy and 0-d tensor integers are accepted (anything with `__index__`)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {shown(repr(value))}")
    try:
        number = value.__index__()
    except TypeError:  # a float tensor has __index__ but refuses it
        raise ValueError(f"{name} must be an integer, got {shown(repr(value))}") from None
    if not low <= number <= high:
        raise ValueError(range_error(name, number, low, high))
    return number


def check_real(
    name: str, value: object, low: float = 0.0, high: float = MAX_COEFFICIENT, *, open_low: bool = False
) -> float:
    """`value` as a finite float in [low, high] (`(low, high]` with `open_low`), or a ValueError naming `name`:
    booleans, strings, NaN and infinities are refused."""
    if isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        raise ValueError(f"{name} must be a number, got {shown(repr(value))}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {shown(repr(value))}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {number}")
    if number < low or (open_low and number == low) or number > high:
        side = "(" if open_low else "["
        raise ValueError(f"{name} must be in {side}{low:g}, {high:g}], got {shown(value)}")
    return number


def check_indices(step: object, m: object, dp_rank: object, rank: object, sizes: tuple) -> list:
    """(step, m, dp_rank, rank) of a micro-batch, each an int in [0, size) (any int where the size is None; a None
    value stays None), or a ValueError naming it."""
    names = ("step", "m", "dp_rank", "rank")
    return [
        None if value is None else check_int(name, value, -INT64_MAX if size is None else 0, (size or 2**63) - 1)
        for name, value, size in zip(names, (step, m, dp_rank, rank), sizes)
    ]
