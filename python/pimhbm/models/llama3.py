"""A Llama-3 decoder in plain JAX, trained under protection by ``pimhbm demo`` and ``pimhbm llama3``.

Token embedding, N decoder layers (RMSNorm eps 1e-5; grouped-query attention with rotary
position embeddings, theta 500000, with Llama 3.1's frequency scaling where the config has it;
SwiGLU MLP), a final RMSNorm and an LM head (untied, or the embedding itself as in Llama 3.2
1B/3B). Weights are kept in the Hugging Face layout (linear weights as [out, in]), so a
checkpoint of the ``model.layers.N.self_attn.q_proj.weight`` kind loads by name: one
safetensors file, several, or a Hugging Face model directory (config.json, and
model.safetensors or its shards with model.safetensors.index.json) with ``load_hf``.

``llama3_8b()`` is the published 8B configuration; ``tiny()`` the same code at a size a 2-core
CPU trains in seconds (byte-level vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm.attention import attention


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (config.json's ``rope_scaling``, rope_type
    "llama3"): low frequencies divided by ``factor``, high ones kept, the band between
    interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"  # parameter (and activation) dtype
    tie_embeddings: bool = False  # the LM head is the embedding (no lm_head parameter)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings rotate pairs)")

    def num_params(self) -> int:
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        return (1 if self.tie_embeddings else 2) * self.vocab * h + h + self.layers * layer

    @classmethod
    def from_hf(cls, config: dict[str, Any], dtype: str = "bfloat16") -> "Config":
        """A Hugging Face LlamaConfig (config.json's contents), checked: what this model does not
        implement is an error that names it."""
        def need(key, kind):
            if key not in config:
                raise ValueError(f"config.json has no {key!r}")
            value = config[key]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise ValueError(f"config.json: {key} must be {kind.__name__}, got {value!r}")
            return value

        if config.get("model_type", "llama") != "llama":
            raise ValueError(f"config.json: model_type {config['model_type']!r} is not a Llama")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {config['hidden_act']!r}: this model is SwiGLU")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError("config.json: attention_bias / mlp_bias: this model has no biases")
        hidden, heads = need("hidden_size", int), need("num_attention_heads", int)
        scaling = config.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"config.json: rope_scaling of type {kind!r} is not implemented "
                                 "(only Llama 3.1's \"llama3\")")
            scaling = RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                  float(scaling["high_freq_factor"]),
                                  int(scaling["original_max_position_embeddings"]))
        return cls(vocab=need("vocab_size", int), hidden=hidden,
                   intermediate=need("intermediate_size", int),
                   layers=need("num_hidden_layers", int), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads", heads)),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   rope_theta=float(config.get("rope_theta", 10000.0)),
                   norm_eps=float(config.get("rms_norm_eps", 1e-6)), dtype=dtype,
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                   rope_scaling=scaling)


def llama3_8b(layers: int = 32, vocab: int = 128256) -> Config:
    return Config(vocab=vocab, hidden=4096, intermediate=14336, layers=layers, heads=32,
                  kv_heads=8, head_dim=128)


def tiny(layers: int = 2, hidden: int = 64, vocab: int = 256) -> Config:
    return Config(vocab=vocab, hidden=hidden, intermediate=int(hidden * 3.5), layers=layers,
                  heads=4, kv_heads=2, head_dim=hidden // 4)


# -- parameters -------------------------------------------------------------------------------

def _layer_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {"input_layernorm": (cfg.hidden,), "q_proj": (q, cfg.hidden), "k_proj": (kv, cfg.hidden),
            "v_proj": (kv, cfg.hidden), "o_proj": (cfg.hidden, q),
            "post_attention_layernorm": (cfg.hidden,), "gate_proj": (cfg.intermediate, cfg.hidden),
            "up_proj": (cfg.intermediate, cfg.hidden), "down_proj": (cfg.hidden, cfg.intermediate)}


def init(key: jax.Array, cfg: Config) -> dict[str, Any]:
    """Random weights (normal, std 0.02; norms at one) in the parameter dtype."""
    dtype = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(key, 2 + 9 * cfg.layers))

    def weight(shape):
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    params = {"embed": weight((cfg.vocab, cfg.hidden)),
              "layers": [{name: weight(shape) for name, shape in _layer_shapes(cfg).items()}
                         for _ in range(cfg.layers)],
              "norm": jnp.ones((cfg.hidden,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = weight((cfg.vocab, cfg.hidden))
    return params


def abstract_params(cfg: Config) -> dict[str, Any]:
    """The parameters' shapes and dtypes (ShapeDtypeStructs): prewarm without memory."""
    dtype = jnp.dtype(cfg.dtype)
    sds = lambda shape: jax.ShapeDtypeStruct(shape, dtype)
    params = {"embed": sds((cfg.vocab, cfg.hidden)),
              "layers": [{n: sds(s) for n, s in _layer_shapes(cfg).items()}
                         for _ in range(cfg.layers)],
              "norm": sds((cfg.hidden,))}
    if not cfg.tie_embeddings:
        params["lm_head"] = sds((cfg.vocab, cfg.hidden))
    return params


# -- the model --------------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(d: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """The rotary inverse frequencies of a head of d dimensions (float32, d / 2)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if scaling is None:
        return inv_freq
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelen < high_wavelen, inv_freq,
                     jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, between))


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, Hugging Face convention: the two halves of each head rotate together."""
    d = x.shape[-1]
    inv_freq = rope_frequencies(d, theta, scaling)
    angles = positions[:, None].astype(jnp.float32) * inv_freq[None, :]  # [T, d/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., d // 2:], x32[..., :d // 2]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:  # w: [out, in]
    return jnp.einsum("...i,oi->...o", x, w)


# attention_impl: jax.nn.dot_product_attention's implementations ("xla", "cudnn", None: XLA picks)
# or this one: pimhbm.attention, whose replays are bit-identical without XLA's flag (bf16 only).
PIMHBM_ATTENTION = "pimhbm"


def decoder_layer(p: dict[str, jax.Array], x: jax.Array, cfg: Config,
                  attention_impl: str | None = None) -> jax.Array:
    b, t, _ = x.shape
    h = rms_norm(x, p["input_layernorm"], cfg.norm_eps)
    q = _linear(h, p["q_proj"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k = _linear(h, p["k_proj"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = _linear(h, p["v_proj"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    pos = jnp.arange(t)
    q = rope(q, pos, cfg.rope_theta, cfg.rope_scaling)
    k = rope(k, pos, cfg.rope_theta, cfg.rope_scaling)
    if attention_impl == PIMHBM_ATTENTION:
        a = attention(q, k, v)
    else:
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_impl)
    x = x + _linear(a.reshape(b, t, cfg.heads * cfg.head_dim), p["o_proj"])
    h = rms_norm(x, p["post_attention_layernorm"], cfg.norm_eps)
    mlp = jax.nn.silu(_linear(h, p["gate_proj"])) * _linear(h, p["up_proj"])
    return x + _linear(mlp, p["down_proj"])


# Vocabularies up to this size are embedded by a one-hot matrix product.
ONE_HOT_EMBED_MAX_VOCAB = 1024


def embed(table: jax.Array, tokens: jax.Array, ordered: bool = False) -> jax.Array:
    """Rows of ``table`` [vocab, hidden] for int32 ``tokens``. The gradient of a gather is a
    scatter-add, which XLA makes bit-repeatable on GPUs only under its deterministic flag, at a
    high cost (54 ms against 0.6 at 8B dimensions, bench/NOTES.md); for small vocabularies
    (byte-level models) a one-hot product is exact (one non-zero term per output), repeatable
    and cheap. Larger vocabularies gather; with ``ordered`` their gradient is summed in a fixed
    order (``ordered_gather``): repeatable without the flag."""
    if table.shape[0] <= ONE_HOT_EMBED_MAX_VOCAB:
        # HIGHEST: on GPUs a float32 product otherwise runs in TF32 and would round the rows.
        return jnp.einsum("btv,vh->bth", jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype),
                          table, precision=jax.lax.Precision.HIGHEST)
    if ordered:
        return ordered_gather(table.shape[0], table, tokens)
    return table[tokens]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ordered_gather(vocab: int, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``, whose gradient sums each row's cotangents in a fixed order: the token
    positions sorted by row (a stable sort), each row's run summed by a segmented scan (float32;
    a fixed tree, whatever the device), the sums written once each. No atomics, so two runs
    agree bit for bit; about 3 ms at 16384 tokens of 4096 (bench/determinism_bisect.py)."""
    return table[tokens]


def _ordered_gather_fwd(vocab, table, tokens):
    return table[tokens], tokens


def _ordered_gather_bwd(vocab, tokens, g):
    ids = tokens.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    ids = ids[order]
    rows = g.reshape(ids.shape[0], -1).astype(jnp.float32)[order]
    new = ids[1:] != ids[:-1]
    starts = jnp.concatenate([jnp.ones((1,), bool), new])
    ends = jnp.concatenate([new, jnp.ones((1,), bool)])

    def combine(a, b):  # a segmented sum: a run restarts where b starts one
        return a[0] | b[0], jnp.where(b[0][:, None], b[1], a[1] + b[1])
    _, sums = jax.lax.associative_scan(combine, (starts, rows))
    # Each row's sum sits at its run's last position: written once, every other one dropped.
    target = jnp.where(ends, ids, vocab)
    grad = jnp.zeros((vocab, rows.shape[1]), jnp.float32).at[target].set(sums, mode="drop")
    return grad.astype(g.dtype), None


ordered_gather.defvjp(_ordered_gather_fwd, _ordered_gather_bwd)


def forward(params: dict[str, Any], tokens: jax.Array, cfg: Config,
            attention_impl: str | None = None, ordered: bool = False) -> jax.Array:
    """Logits [B, T, vocab] (float32) of int32 tokens [B, T]. ``ordered``: the embedding's
    gradient summed in a fixed order (``embed``)."""
    x = embed(params["embed"], tokens, ordered)
    for layer in params["layers"]:
        x = decoder_layer(layer, x, cfg, attention_impl)
    x = rms_norm(x, params["norm"], cfg.norm_eps)
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return _linear(x, head).astype(jnp.float32)


def loss(params: dict[str, Any], batch: dict[str, jax.Array], cfg: Config,
         attention_impl: str | None = None, ordered: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of batch["tokens"] [B, T+1]."""
    tokens = batch["tokens"]
    logits = forward(params, tokens[:, :-1], cfg, attention_impl, ordered)
    logp = jax.nn.log_softmax(logits)
    # A one-hot product rather than take_along_axis: no scatter in the backward pass (see embed).
    targets = jax.nn.one_hot(tokens[:, 1:], cfg.vocab, dtype=logp.dtype)
    return -jnp.mean(jnp.sum(logp * targets, axis=-1))


# -- Hugging Face safetensors -----------------------------------------------------------------

def hf_names(cfg: Config) -> dict[str, tuple]:
    """Hugging Face tensor name -> path into our parameter tree."""
    names = {"model.embed_tokens.weight": ("embed",), "model.norm.weight": ("norm",)}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = ("lm_head",)
    for i in range(cfg.layers):
        for n in _layer_shapes(cfg):
            group = "self_attn" if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else (
                "mlp" if n.endswith(("gate_proj", "up_proj", "down_proj")) else None)
            hf = f"model.layers.{i}.{group}.{n}.weight" if group else f"model.layers.{i}.{n}.weight"
            names[hf] = ("layers", i, n)
    return names


def _safetensors():
    try:
        from safetensors import numpy as st
    except ImportError:
        raise ImportError("reading and writing checkpoints needs the safetensors package: "
                          "pip install safetensors (or pim-hbm-bypass[hf])") from None
    return st


def load_safetensors(paths: str | list[str], cfg: Config) -> dict[str, Any]:
    """Weights from Hugging Face safetensors file(s), checked against ``cfg`` by name, shape
    and completeness, cast to the parameter dtype. (With tied embeddings a file's
    lm_head.weight, which some checkpoints keep, is not used.)"""
    load_file = _safetensors().load_file

    tensors: dict[str, np.ndarray] = {}
    for path in [paths] if isinstance(paths, str) else paths:
        tensors.update(load_file(path))
    wanted = hf_names(cfg)
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    shapes = abstract_params(cfg)
    params = jax.tree.map(lambda s: None, shapes)
    dtype = jnp.dtype(cfg.dtype)
    for name, path in wanted.items():
        want = shapes
        for k in path:
            want = want[k]
        array = tensors[name]
        if tuple(array.shape) != tuple(want.shape):
            raise ValueError(f"{name} has shape {tuple(array.shape)}, the config wants "
                             f"{tuple(want.shape)}")
        node = params
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = jnp.asarray(np.asarray(array, np.float32)).astype(dtype)
    return params


def save_safetensors(params: dict[str, Any], path: str, cfg: Config) -> None:
    """Writes the parameters under their Hugging Face names (float32)."""
    save_file = _safetensors().save_file

    out = {}
    for name, tree_path in hf_names(cfg).items():
        node = params
        for k in tree_path:
            node = node[k]
        out[name] = np.asarray(node, np.float32)
    save_file(out, path)


def load_hf(directory: str, dtype: str = "bfloat16") -> tuple[dict[str, Any], Config]:
    """A Hugging Face model directory: config.json read into a Config, and the weights from
    model.safetensors, or from the shards model.safetensors.index.json names (each inside the
    directory). Returns (params, config)."""
    import json
    import os

    def read_json(name):
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not JSON: {err}") from None

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory")
    cfg = Config.from_hf(read_json("config.json"), dtype)
    if os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        weight_map = read_json("model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("model.safetensors.index.json has no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".safetensors"):
                raise ValueError(f"model.safetensors.index.json names {name!r}: shards must be "
                                 ".safetensors files in the model's directory")
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor "
                                "model.safetensors.index.json")
    return load_safetensors([os.path.join(directory, f) for f in files], cfg), cfg
