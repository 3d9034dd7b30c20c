"""Model shapes for `multirail bench kv`: what one token's KV cache weighs, per layer.

A model config is a small YAML file (the bundled ones are in `models/` beside this module):

    name: Llama-3.1-70B            # shown in the output and the JSON
    aliases: [meta-llama/Llama-3.1-70B]
    attention: gqa                 # mha | gqa | mla
    layers: 80
    kv_heads: 8                    # mha/gqa
    head_dim: 128                  # mha/gqa
    kv_lora_rank: 512              # mla
    qk_rope_head_dim: 64           # mla
    dtype: bfloat16                # bfloat16|bf16|float16|fp16|float32|fp32|fp8|float8|int8

Bytes per token per layer, for the share of one tensor-parallel rank (`--tp`):
* MHA/GQA: 2 (K and V) x kv_heads_per_rank x head_dim x dtype bytes, where
  kv_heads_per_rank = kv_heads / tp (KV heads are split across ranks; when tp > kv_heads each
  rank holds one replicated head, so tp must divide kv_heads or kv_heads must divide tp).
* MLA (DeepSeek-V3/R1): one compressed latent per token, (kv_lora_rank + qk_rope_head_dim) x
  dtype bytes, shared by all heads, so not split by TP.

Pure: no engine, no network; unit-tested in tests/test_bench_kv.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multirail.bench.core import UsageError

MODELS_DIR = Path(__file__).resolve().parent / "models"

DTYPE_BYTES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
    "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}
ATTENTION = ("mha", "gqa", "mla")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    attention: str  # mha | gqa | mla
    layers: int
    dtype: str
    dtype_bytes: int
    kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    source: str = ""  # the YAML file it came from

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank holds (MHA/GQA); checks that tp and kv_heads fit together."""
        if tp < 1:
            raise UsageError(f"--tp must be at least 1, not {tp}")
        if self.attention == "mla":
            return 0
        if tp <= self.kv_heads:
            if self.kv_heads % tp:
                raise UsageError(f"--tp {tp} does not divide {self.name}'s {self.kv_heads} KV heads "
                                 f"(use a divisor of {self.kv_heads}, or a multiple of it to replicate heads)")
            return self.kv_heads // tp
        if tp % self.kv_heads:
            raise UsageError(f"--tp {tp} is larger than {self.name}'s {self.kv_heads} KV heads but not a "
                             f"multiple of them, so the heads cannot be replicated evenly")
        return 1

    def bytes_per_token_layer(self, tp: int = 1) -> int:
        """KV bytes of one token in one layer on one TP rank."""
        if self.attention == "mla":
            if tp < 1:
                raise UsageError(f"--tp must be at least 1, not {tp}")
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    def formula(self, tp: int = 1) -> str:
        """How bytes_per_token_layer is made, for the printed summary."""
        b = self.bytes_per_token_layer(tp)
        if self.attention == "mla":
            return (f"({self.kv_lora_rank} latent + {self.qk_rope_head_dim} rope) x {self.dtype_bytes} B "
                    f"= {b} B (MLA: one latent per token, not split by TP)")
        per = self.kv_heads_per_rank(tp)
        heads = f"{per} of {self.kv_heads} KV heads" if tp > 1 else f"{per} KV heads"
        return f"2 (K,V) x {heads} x {self.head_dim} head dim x {self.dtype_bytes} B = {b} B"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "attention": self.attention, "layers": self.layers, "dtype": self.dtype,
                "dtype_bytes": self.dtype_bytes, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                "source": self.source}


def _int_field(d: dict[str, Any], key: str, where: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UsageError(f"{where}: {key!r} must be a positive integer, got {v!r}")
    return v


def parse_model(data: Any, where: str) -> ModelSpec:
    """A ModelSpec from a YAML document's parsed value; UsageError naming what is wrong."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping with name, attention, layers, ..., got "
                         f"{type(data).__name__}")
    attention = str(data.get("attention", "")).lower()
    if attention not in ATTENTION:
        raise UsageError(f"{where}: 'attention' must be one of {', '.join(ATTENTION)}, got {data.get('attention')!r}")
    dtype = str(data.get("dtype", "bfloat16")).lower()
    if dtype not in DTYPE_BYTES:
        raise UsageError(f"{where}: unknown dtype {data.get('dtype')!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    name = data.get("name") or Path(where).stem
    layers = _int_field(data, "layers", where)
    if attention == "mla":
        return ModelSpec(name=str(name), attention=attention, layers=layers, dtype=dtype,
                         dtype_bytes=DTYPE_BYTES[dtype], kv_lora_rank=_int_field(data, "kv_lora_rank", where),
                         qk_rope_head_dim=_int_field(data, "qk_rope_head_dim", where), source=where)
    return ModelSpec(name=str(name), attention=attention, layers=layers, dtype=dtype,
                     dtype_bytes=DTYPE_BYTES[dtype], kv_heads=_int_field(data, "kv_heads", where),
                     head_dim=_int_field(data, "head_dim", where), source=where)


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"cannot read model config {str(path)!r}: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise UsageError(f"model config {str(path)!r} is not valid YAML: {msg[:300]}") from None


def bundled() -> dict[str, Path]:
    """Bundled model configs by file stem (lower case)."""
    return {p.stem.lower(): p for p in sorted(MODELS_DIR.glob("*.yaml"))}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def load_model(spec: str) -> ModelSpec:
    """`spec` is a bundled model's name (file stem, `name`, or an alias, any case) or a path to
    a YAML file (anything ending in .yaml/.yml or containing a path separator)."""
    if not spec or not spec.strip():
        raise UsageError("--model needs a model name or a YAML file")
    if spec.endswith((".yaml", ".yml")) or "/" in spec and Path(spec).exists():
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"model config {spec!r} does not exist")
        return parse_model(_read_yaml(path), str(path))
    want = _norm(spec)
    for stem, path in bundled().items():
        data = _read_yaml(path)
        names = [stem, str(data.get("name", "")) if isinstance(data, dict) else ""]
        names += [str(a) for a in (data.get("aliases") or [])] if isinstance(data, dict) else []
        if want in {_norm(n) for n in names if n}:
            return parse_model(data, str(path))
    raise UsageError(f"unknown model {spec!r}; bundled: {', '.join(bundled())} (or pass a YAML file: "
                     "name, attention, layers, kv_heads, head_dim, dtype; docs/bench-kv.md)")
