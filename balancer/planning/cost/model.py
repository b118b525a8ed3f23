"""The cost model: how much work one document (and one micro-batch) is.

`cost(d) = attn_coef * pairs(d) + linear_coef * d`, with `pairs(d) = d*(d+1)/2` for causal attention and `d*d`
otherwise, plus `fixed` once per micro-batch. This module is the only owner of that formula: the planner, the
metrics, the benchmarks and the telemetry all call it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from attention.geometry import attention_pairs
from balancer.limits import MAX_COEFFICIENT
from balancer.planning.cost.fit import TERMS, fit_cost_model
from balancer.strict_json import FORMAT_KEYS, FormatSpec, anything, boolean, integer, number, obj, string


@dataclass(frozen=True)
class Hardware:
    """Public figures of one device and its CP link, turned into seconds by `CostModel.from_model(hardware=...)`.

    `flops`: dense bf16 peak FLOP/s of one device; `attn_efficiency` / `linear_efficiency`: the share of peak that
    attention and matmul kernels reach; `link_bandwidth`: bytes/s one direction of the CP link; `link_latency`:
    seconds per point-to-point transfer; `tile`: attention tile edge in tokens (a document piece pays at least one
    tile: the per-piece overhead); `launch`: seconds of launch overhead per kernel call; `source`: where the figures
    come from.
    """

    name: str
    flops: float
    attn_efficiency: float
    linear_efficiency: float
    link_bandwidth: float
    link_latency: float
    tile: int = 128
    launch: float = 5e-6
    source: str = ""


HARDWARE = {
    h.name: h
    for h in (
        Hardware(
            "h100-nvlink",
            989e12,
            0.5,
            0.6,
            450e9,
            10e-6,
            source="NVIDIA H100 SXM datasheet (989 TFLOP/s dense "
            "bf16, NVLink 4 900 GB/s bidirectional); NCCL p2p latency ~10 us (nccl-tests)",
        ),
        Hardware(
            "h100-ib",
            989e12,
            0.5,
            0.6,
            50e9,
            20e-6,
            source="NVIDIA H100 SXM datasheet; ConnectX-7 NDR "
            "InfiniBand 400 Gb/s per GPU; NCCL inter-node latency ~20 us",
        ),
        Hardware(
            "h200-nvlink",
            989e12,
            0.5,
            0.6,
            450e9,
            10e-6,
            source="NVIDIA H200 SXM datasheet (989 TFLOP/s "
            "dense bf16, same compute as H100, NVLink 900 GB/s bidirectional)",
        ),
        Hardware("h200-ib", 989e12, 0.5, 0.6, 50e9, 20e-6, source="NVIDIA H200 SXM datasheet; NDR InfiniBand 400 Gb/s"),
        Hardware(
            "a100-nvlink",
            312e12,
            0.5,
            0.6,
            300e9,
            10e-6,
            source="NVIDIA A100 SXM datasheet (312 TFLOP/s dense bf16, NVLink 3 600 GB/s bidirectional)",
        ),
        Hardware("a100-ib", 312e12, 0.5, 0.6, 25e9, 20e-6, source="NVIDIA A100 SXM datasheet; HDR InfiniBand 200 Gb/s"),
        Hardware(
            "cpu",
            50e9,
            0.2,
            0.4,
            2e9,
            50e-6,
            tile=1,
            launch=20e-6,
            source="one x86 core with AVX2 FMA "
            "(2 x 8 fp32 FMA/cycle at ~3 GHz ~ 100 GFLOP/s fp32 peak, taken as 50); gloo over loopback TCP "
            "~2 GB/s: rough figures, run `balancer calibrate` instead",
        ),
    )
}

_COEFFICIENTS = (*TERMS, "kv_bytes_per_token")  # the time terms (fit.TERMS), then the bytes behind a token-hop
COST_FORMAT = FormatSpec("balancer.cost", 2, {"balancer.cost/1": 1})  # 2: format_version written (fields as in 1)
FORMAT = COST_FORMAT.name
COST_FIELDS = {  # the model's own keys, as `to_dict` writes them (also the `cost_model` record of a plan)
    **{
        name: number(min=0, max=MAX_COEFFICIENT, required=name in ("attn_coef", "linear_coef"))
        for name in _COEFFICIENTS
    },
    "causal": boolean(required=False),
    "window": integer(min=1, nullable=True, required=False),
    "comm_overlap": boolean(required=False),
}
COST_SCHEMA = obj({**FORMAT_KEYS, **COST_FIELDS, "report": anything(required=False)})
_DIM = integer(min=1, max=2**31 - 1)  # model dimensions: positive, and small enough that FLOP counts stay finite
CONFIG_KEYS = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_heads"), _DIM),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "num_key_value_heads", "head_dim"), _DIM),
    **dict.fromkeys(("intermediate_size", "n_inner", "sliding_window"), _DIM),
    "vocab_size": integer(min=0, max=2**31 - 1),
    "use_sliding_window": boolean(),
    "hidden_act": string(),
}


@dataclass(frozen=True)
class CostModel:
    """Per-document cost: `attn_coef * pairs(d) + linear_coef * d + piece_coef`; `fixed` is charged once per
    micro-batch. `pairs` follows `causal` and the sliding `window` (None: full attention).

    Communication terms, used only by the layout-aware prediction (`balancer.planning.cost.predict`): `comm_coef` per
    token whose K/V travels one ring hop (forward + backward, all layers), `comm_latency` per ring step (or per
    all-gather), `kv_bytes_per_token` the bytes behind one such token-hop (for reports), `comm_overlap` whether a
    ring step's transfer overlaps its compute (`max(compute, transfer)`, GPUs with copy engines) or adds to it (CPU
    ranks whose transfers take cycles from the same cores). `piece_coef` is the overhead
    of one document piece: one document's block in one attention call on one rank (forward + backward, all layers).

    Units are whatever the coefficients are in (FLOPs for `from_model` without hardware, seconds for `fit` and for
    `from_model(hardware=...)`); only ratios matter to the planner. With the new terms left at 0 the model is the
    plain `attn_coef * pairs + linear_coef * d` (+ `fixed`).
    """

    attn_coef: float
    linear_coef: float
    fixed: float = 0.0
    causal: bool = True
    window: int | None = None
    piece_coef: float = 0.0
    comm_coef: float = 0.0
    comm_latency: float = 0.0
    kv_bytes_per_token: float = 0.0
    comm_overlap: bool = True

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if (
                isinstance(value, (bool, np.bool_))
                or not isinstance(value, (int, float, np.floating, np.integer))
                or not 0 <= value <= MAX_COEFFICIENT
            ):
                raise ValueError(f"CostModel.{name} must be a finite number in [0, {MAX_COEFFICIENT:g}], got {value!r}")
        if self.attn_coef == 0 and self.linear_coef == 0:
            raise ValueError("CostModel needs attn_coef > 0 or linear_coef > 0 (both are 0)")
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"CostModel.causal must be True or False, got {self.causal!r}")
        if isinstance(self.window, (bool, np.bool_)) or (
            self.window is not None and not isinstance(self.window, (int, float, np.integer, np.floating))
        ):
            raise ValueError(
                f"CostModel.window must be a positive integer (keys per query) or None, got {self.window!r}"
            )
        if self.window is not None and (
            not np.isfinite(self.window) or int(self.window) != self.window or self.window < 1
        ):
            raise ValueError(
                f"CostModel.window must be a positive integer (keys per query) or None, got {self.window!r}"
            )
        if self.window is not None:
            object.__setattr__(self, "window", int(self.window))
        if not isinstance(self.comm_overlap, (bool, np.bool_)):
            raise ValueError(f"CostModel.comm_overlap must be true or false, got {self.comm_overlap!r}")

    @property
    def has_comm(self) -> bool:
        """True when the model charges communication or per-piece overhead (the layout then matters)."""
        return bool(self.comm_coef or self.comm_latency or self.piece_coef)

    def pairs(self, lengths: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """Attention pairs per document under this model's mask (`causal`, `window`)."""
        return attention_pairs(lengths, self.causal, self.window)

    def cost(self, lengths: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """Vectorised per-document cost (float64 array of the input's shape; `fixed` not included)."""
        d = np.asarray(lengths, dtype=np.float64)
        out = self.attn_coef * self.pairs(d) + self.linear_coef * d
        return out + self.piece_coef * (d > 0) if self.piece_coef else out

    def attention_cost(self, lengths: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """The attention terms of `cost` per document: `attn_coef * pairs(d) + piece_coef` (a document's piece is
        one block of an attention call); the rest of `cost` is per-token work."""
        d = np.asarray(lengths, dtype=np.float64)
        out = self.attn_coef * self.pairs(d)
        return out + self.piece_coef * (d > 0) if self.piece_coef else out

    __call__ = cost

    def micro_batch_cost(self, lengths: np.ndarray | Sequence[int]) -> float:
        """Cost of one micro-batch holding documents of these lengths, `fixed` included."""
        return float(self.cost(lengths).sum() + self.fixed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def save(self, path: str | os.PathLike, **report: Any) -> None:
        """Write the model as JSON (`{"format", "format_version", fields..., "report": {...}}`, docs/cost-model.md),
        atomically (a temporary file renamed over `path`: a link at `path` is replaced, never written through);
        `report` is free-form (a calibration's errors and settings) and ignored by `load`."""
        from balancer.files import atomic_write

        payload = {**COST_FORMAT.header(), **self.to_dict()}
        if report:
            payload["report"] = report
        atomic_write(path, lambda f: f.write(json.dumps(payload, indent=1).encode()))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        """Read a model written by `save`, or a hand-written JSON object with at least `attn_coef` and
        `linear_coef`. Strict (balancer.strict_json): exact types (`"causal": "false"` and `"window": true` are
        refused), ranges, no unknown keys, a known `format` / `format_version`; one ValueError naming the file and
        the key."""
        from balancer.strict_json import check, check_format, load_json

        path = os.fspath(path)
        data = load_json(path)
        version = check_format(data, path, COST_FORMAT, required=False)
        check(data, COST_SCHEMA, path, version=version)
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_model(
        cls,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        intermediate_size: int | None = None,
        vocab_size: int = 0,
        head_dim: int | None = None,
        gated_mlp: bool = True,
        causal: bool = True,
        fixed: float = 0.0,
        window: int | None = None,
        hardware: str | Hardware | None = None,
        dtype_bytes: int = 2,
    ) -> CostModel:
        """Analytic training FLOPs (forward + backward) of a decoder-only transformer, per document.

        - attention, per (query, key) pair: forward QK^T and PV are `2 * head_dim` FLOPs each per head, backward is
          twice the forward, so `attn_coef = 12 * num_layers * num_heads * head_dim`;
        - linear, per token: `6 * P_matmul` (2 forward + 4 backward per weight) where
          `P_matmul = num_layers * (hidden*(num_heads*head_dim) + 2*hidden*(num_kv_heads*head_dim)
          + (num_heads*head_dim)*hidden + k*hidden*intermediate) + hidden*vocab` with `k = 3` for a gated (SwiGLU)
          MLP and `k = 2` otherwise; the input embedding is a lookup, not a matmul, and norms/activations are ignored.

        `hardware` (a name in `HARDWARE` or a `Hardware`) turns FLOPs into seconds and adds the overhead and
        communication terms (docs/cost-model.md): `attn_coef / (flops * attn_efficiency)`,
        `linear_coef / (flops * linear_efficiency)`, `piece_coef` = half a `tile x tile` block of attention work,
        `kv_bytes_per_token = num_layers * 2 * kv_dim * (2 * dtype_bytes + 4)` (forward K/V, backward K/V again and
        float32 dK/dV), `comm_coef = kv_bytes_per_token / link_bandwidth`,
        `comm_latency = 3 * num_layers * (link_latency + launch)` per ring step (one forward and two backward
        transfers per layer, each with its kernel launch).
        """
        attn, linear, kv_dim = _training_flops(
            hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size, head_dim, gated_mlp
        )
        if hardware is None:
            return cls(attn_coef=attn, linear_coef=linear, fixed=float(fixed), causal=causal, window=window)
        hw = _hardware(hardware)
        from balancer.limits import check_int

        dtype_bytes = check_int("CostModel.from_model: dtype_bytes", dtype_bytes, 1, 64)
        attn_s = attn / (hw.flops * hw.attn_efficiency)
        kv_bytes = float(num_layers * 2 * kv_dim * (2 * dtype_bytes + 4))
        return cls(
            attn_coef=attn_s,
            linear_coef=linear / (hw.flops * hw.linear_efficiency),
            fixed=float(fixed),
            causal=causal,
            window=window,
            piece_coef=attn_s * hw.tile * hw.tile / 2.0,
            comm_coef=kv_bytes / hw.link_bandwidth,
            comm_latency=3.0 * num_layers * (hw.link_latency + hw.launch),
            kv_bytes_per_token=kv_bytes,
        )

    @classmethod
    def from_config(
        cls, config: dict, hardware: str | Hardware | None = None, *, source: str = "model config"
    ) -> CostModel:
        """`from_model` on a Hugging Face style config dict (`config.json` keys); `sliding_window` becomes
        `window` unless `use_sliding_window` is false. The keys read are checked strictly (positive integers, not
        strings or booleans; see `CONFIG_KEYS`); other keys are ignored. Errors name `source` (the file) and the key."""
        from balancer.strict_json import check

        if not isinstance(config, dict):
            raise ValueError(f"{source}: a model config must be a JSON object, got {type(config).__name__}")

        def get(*names, default=None):
            for n in names:
                if n in config and config[n] is not None:
                    return check(config[n], CONFIG_KEYS[n], source, n)
            return default

        hidden = get("hidden_size", "n_embd", "d_model")
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        heads = get("num_attention_heads", "n_head", "num_heads")
        for value, names in ((hidden, "hidden_size"), (layers, "num_hidden_layers"), (heads, "num_attention_heads")):
            if value is None:
                raise ValueError(f'{source}: missing key "{names}" (needed for the cost model)')
        head_dim = get("head_dim")
        if head_dim is None and hidden % heads:
            raise ValueError(
                f'{source}: "hidden_size" {hidden} is not divisible by "num_attention_heads" {heads} and there is no '
                '"head_dim"'
            )
        window = get("sliding_window") if get("use_sliding_window", default=True) else None
        return cls.from_model(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", default=heads),
            intermediate_size=get("intermediate_size", "n_inner", default=4 * hidden),
            vocab_size=get("vocab_size", default=0),
            head_dim=head_dim,
            gated_mlp=get("hidden_act", default="silu") in ("silu", "swiglu", "geglu"),
            window=window,
            hardware=hardware,
        )

    @classmethod
    def fit(
        cls,
        lengths: Sequence,
        seconds: ArrayLike,
        causal: bool = True,
        fit_fixed: bool = True,
        *,
        window: int | None = None,
        cp: int | Sequence[int] = 1,
        layout: str | Sequence[str] = "zigzag",
        method: str | Sequence[str] = "ring",
        fit_pieces: bool = False,
        fit_comm: bool = False,
        layout_options: dict | None = None,
    ) -> CostModel:
        """Fit coefficients to measured timings with non-negative least squares on relative errors.

        `lengths[i]` is either one document length or a sequence of document lengths that ran together as one
        measured micro-batch; `seconds[i]` is its measured time (the slowest CP rank's, for `cp[i] > 1`). With
        `fit_fixed` a per-micro-batch constant is fitted as well, with `fit_pieces` the per-piece overhead, with
        `fit_comm` the communication terms (`comm_coef`, `comm_latency`; needs samples with cp > 1). `cp`, `layout`
        (CPLayout kind) and `method` are one value for all samples or one per sample. See
        balancer.planning.cost.fit for the method (the ring step's max(compute, transfer) makes it piecewise linear).
        """
        return fit_cost_model(
            cls,
            lengths,
            seconds,
            causal=causal,
            window=window,
            fit_fixed=fit_fixed,
            fit_pieces=fit_pieces,
            fit_comm=fit_comm,
            cp=cp,
            layout=layout,
            method=method,
            layout_options=layout_options or {},
        )


def _hardware(hardware: str | Hardware) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in HARDWARE:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)} or a Hardware, got {hardware!r}")
    return HARDWARE[hardware]


def _training_flops(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    intermediate_size: int | None,
    vocab_size: int,
    head_dim: int | None,
    gated_mlp: bool,
) -> tuple[float, float, int]:
    """(FLOPs per attention pair, FLOPs per token, K/V width) of `CostModel.from_model` (its docstring has the
    formulas); ValueError naming a bad argument."""
    from balancer.limits import check_int

    def positive(name: str, value, low: int = 1) -> int:
        return check_int(f"CostModel.from_model: {name}", value, low, 2**40)

    hidden_size = positive("hidden_size", hidden_size)
    num_layers = positive("num_layers", num_layers)
    num_heads = positive("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else positive("num_kv_heads", num_kv_heads)
    intermediate_size = (
        4 * hidden_size if intermediate_size is None else positive("intermediate_size", intermediate_size, 0)
    )
    vocab_size = positive("vocab_size", vocab_size, 0)
    if not isinstance(gated_mlp, (bool, np.bool_)):
        raise ValueError(f"CostModel.from_model: gated_mlp must be True or False, got {gated_mlp!r}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; pass head_dim")
        head_dim = hidden_size // num_heads
    head_dim = positive("head_dim", head_dim)
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    mlp_mats = 3 if gated_mlp else 2
    per_layer = (
        hidden_size * q_dim
        + 2 * hidden_size * kv_dim
        + q_dim * hidden_size
        + mlp_mats * hidden_size * intermediate_size
    )
    matmul_params = num_layers * per_layer + hidden_size * vocab_size
    return 12.0 * num_layers * num_heads * head_dim, 6.0 * float(matmul_params), kv_dim
