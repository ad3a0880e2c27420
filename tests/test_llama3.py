"""The Llama-3 model against an independent float64 NumPy implementation, and the safetensors
loader against a checkpoint written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimhbm.models import llama3

from conftest import cached_env


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """The comparisons with the float64 reference are made at full float32 precision: on GPUs
    JAX's default for float32 products is TF32 (10-bit mantissa)."""
    with jax.default_matmul_precision("highest"):
        yield

# -- an independent reference, float64 NumPy, written from the Llama-3 definition --------------


def np_rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope(x, theta=500000.0):  # x: [T, heads, d]; rotate_half convention
    t, _, d = x.shape
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def np_layer(p, x, cfg):  # x: [T, H] of one sequence
    t = x.shape[0]
    h = np_rms(x, p["input_layernorm"])
    q = (h @ p["q_proj"].T).reshape(t, cfg.heads, cfg.head_dim)
    k = (h @ p["k_proj"].T).reshape(t, cfg.kv_heads, cfg.head_dim)
    v = (h @ p["v_proj"].T).reshape(t, cfg.kv_heads, cfg.head_dim)
    q, k = np_rope(q), np_rope(k)
    group = cfg.heads // cfg.kv_heads
    out = np.zeros((t, cfg.heads, cfg.head_dim))
    mask = np.tril(np.ones((t, t), bool))
    for hd in range(cfg.heads):
        kv = hd // group
        s = q[:, hd] @ k[:, kv].T / np.sqrt(cfg.head_dim)
        s = np.where(mask, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[:, hd] = w @ v[:, kv]
    x = x + out.reshape(t, -1) @ p["o_proj"].T
    h = np_rms(x, p["post_attention_layernorm"])
    g = h @ p["gate_proj"].T
    return x + ((g / (1 + np.exp(-g))) * (h @ p["up_proj"].T)) @ p["down_proj"].T


def np_forward(params, tokens, cfg):
    outs = []
    for seq in tokens:
        x = params["embed"][seq]
        for layer in params["layers"]:
            x = np_layer(layer, x, cfg)
        outs.append(np_rms(x, params["norm"]) @ params["lm_head"].T)
    return np.stack(outs)


def to64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def fp32_config(**kw):
    return llama3.Config(**{**llama3.tiny().__dict__, "dtype": "float32", **kw})


def test_one_layer_matches_the_numpy_reference(rng):
    cfg = fp32_config(hidden=32, intermediate=96, heads=4, kv_heads=2, head_dim=8, layers=1)
    params = llama3.init(jax.random.key(int(rng.integers(1 << 30))), cfg)
    layer = jax.tree.map(lambda a: a * 5.0 if a.ndim == 2 else a, params["layers"][0])  # not tiny
    x = rng.standard_normal((2, 11, 32)).astype(np.float32)
    got = np.asarray(jax.jit(lambda p, x: llama3.decoder_layer(p, x, cfg))(layer, x))
    want = np.stack([np_layer(to64(layer), x64, cfg) for x64 in x.astype(np.float64)])
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, err


def test_whole_model_matches_the_numpy_reference(rng):
    cfg = fp32_config(layers=2)
    params = llama3.init(jax.random.key(int(rng.integers(1 << 30))), cfg)
    params = jax.tree.map(lambda a: a * 10.0 if a.ndim == 2 else a, params)
    tokens = rng.integers(0, cfg.vocab, size=(2, 13)).astype(np.int32)
    got = np.asarray(jax.jit(lambda p, t: llama3.forward(p, t, cfg))(params, tokens))
    want = np_forward(to64(params), tokens, cfg)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, err


def test_bf16_model_stays_close_to_the_reference(rng):
    cfg = llama3.tiny()
    params = llama3.init(jax.random.key(3), cfg)
    params = jax.tree.map(lambda a: a * 10.0 if a.ndim == 2 else a, params)
    tokens = rng.integers(0, cfg.vocab, size=(1, 16)).astype(np.int32)
    got = np.asarray(jax.jit(lambda p, t: llama3.forward(p, t, cfg))(params, tokens))
    want = np_forward(to64(params), tokens, cfg)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 3e-2, err  # bf16 weights and activations


def test_loss_is_the_mean_next_token_cross_entropy(rng):
    cfg = fp32_config(layers=1)
    params = llama3.init(jax.random.key(5), cfg)
    tokens = rng.integers(0, cfg.vocab, size=(2, 9)).astype(np.int32)
    logits = np_forward(to64(params), tokens[:, :-1], cfg)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                  keepdims=True)) - logits.max(-1, keepdims=True)
    want = -np.mean(np.take_along_axis(logp, tokens[:, 1:, None], -1))
    got = float(llama3.loss(params, {"tokens": jnp.asarray(tokens)}, cfg))
    assert got == pytest.approx(want, rel=1e-5)


def test_8b_configuration():
    cfg = llama3.llama3_8b()
    assert (cfg.vocab, cfg.hidden, cfg.intermediate, cfg.layers, cfg.heads, cfg.kv_heads,
            cfg.head_dim) == (128256, 4096, 14336, 32, 32, 8, 128)
    assert 8.0e9 < cfg.num_params() < 8.1e9  # Llama-3-8B: 8.03 B parameters
    shapes = llama3.abstract_params(llama3.llama3_8b(layers=1))
    assert shapes["layers"][0]["k_proj"].shape == (1024, 4096)


def test_safetensors_checkpoint_loads_by_name(tmp_path, rng):
    from safetensors.numpy import save_file

    cfg = fp32_config(layers=2)
    # A checkpoint in the Hugging Face layout, written by hand here.
    tensors = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab, cfg.hidden)),
               "model.norm.weight": rng.standard_normal(cfg.hidden),
               "lm_head.weight": rng.standard_normal((cfg.vocab, cfg.hidden))}
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        tensors |= {pre + "self_attn.q_proj.weight": rng.standard_normal((q, cfg.hidden)),
                    pre + "self_attn.k_proj.weight": rng.standard_normal((kv, cfg.hidden)),
                    pre + "self_attn.v_proj.weight": rng.standard_normal((kv, cfg.hidden)),
                    pre + "self_attn.o_proj.weight": rng.standard_normal((cfg.hidden, q)),
                    pre + "mlp.gate_proj.weight": rng.standard_normal((cfg.intermediate, cfg.hidden)),
                    pre + "mlp.up_proj.weight": rng.standard_normal((cfg.intermediate, cfg.hidden)),
                    pre + "mlp.down_proj.weight": rng.standard_normal((cfg.hidden, cfg.intermediate)),
                    pre + "input_layernorm.weight": rng.standard_normal(cfg.hidden),
                    pre + "post_attention_layernorm.weight": rng.standard_normal(cfg.hidden)}
    tensors = {k: v.astype(np.float32) for k, v in tensors.items()}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    params = llama3.load_safetensors(path, cfg)
    assert np.array_equal(np.asarray(params["layers"][1]["k_proj"]),
                          tensors["model.layers.1.self_attn.k_proj.weight"])
    assert np.array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"])
    # The loaded model computes what the reference computes from the file's tensors.
    tokens = rng.integers(0, cfg.vocab, size=(1, 7)).astype(np.int32)
    got = np.asarray(llama3.forward(params, tokens, cfg))
    want = np_forward(to64(params), tokens, cfg)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # Round trip through our own writer.
    path2 = str(tmp_path / "again.safetensors")
    llama3.save_safetensors(params, path2, cfg)
    again = llama3.load_safetensors(path2, cfg)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))
    # Wrong or missing tensors are named.
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(bad, path)
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(3, 3\)"):
        llama3.load_safetensors(path, cfg)
    del bad["model.norm.weight"]
    save_file(bad, path)
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        llama3.load_safetensors(path, cfg)


def test_one_hot_embedding_equals_the_gather(rng):
    """Small vocabularies embed by a one-hot product (no scatter in the backward pass): values
    and the table's gradient equal the gather's, and larger vocabularies use the gather."""
    for vocab in (7, llama3.ONE_HOT_EMBED_MAX_VOCAB):
        table = jnp.asarray(rng.standard_normal((vocab, 24)), jnp.float32)
        tokens = jnp.asarray(rng.integers(0, vocab, size=(3, 11)), jnp.int32)
        weights = jnp.asarray(rng.standard_normal((3, 11, 24)), jnp.float32)
        np.testing.assert_array_equal(llama3.embed(table, tokens), table[tokens])
        g_onehot = jax.grad(lambda t: jnp.sum(llama3.embed(t, tokens) * weights))(table)
        g_gather = jax.grad(lambda t: jnp.sum(t[tokens] * weights))(table)
        np.testing.assert_allclose(g_onehot, g_gather, rtol=1e-6, atol=1e-6)
    big = jnp.zeros((llama3.ONE_HOT_EMBED_MAX_VOCAB + 1, 4), jnp.float32)
    hlo = jax.jit(llama3.embed).lower(big, jnp.zeros((1, 2), jnp.int32)).as_text()
    assert "gather" in hlo and "dot_general" not in hlo


@pytest.mark.parametrize("device_copy", [True, False])
def test_llama3_tool_with_fsdp_on_four_cpu_devices(tmp_path, device_copy):
    """`pimhbm llama3` on 2 replicas x 2 shards (the tiny configuration of the same code): the
    plain and protected steps are timed, and the campaign of every fault kind ends
    bit-identical with no compilation after prewarm (the tool's exit code says so). Without
    device copies every damaged chunk comes from the other replica, and only the steps with a
    non-finite gradient (applied in part) from the host snapshot."""
    import json
    import subprocess
    import sys

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    out = tmp_path / "llama3.json"
    cmd = [sys.executable, "-m", "pimhbm_cli", "llama3", "--tiny", "--layers", "1", "--tokens",
           "256", "--seq", "32", "--vocab", "256", "--steps", "2", "--devices", "4", "--shard",
           "2", "--campaign-steps", "10", "--faults", "1", "--json", str(out)]
    # With the copy also --profile (a CPU trace has no device timeline: nothing to split).
    cmd += ["--profile", str(tmp_path / "profile")] if device_copy else ["--no-device-copy"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=cached_env(), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["devices"] == 4 and r["shard"] == 2 and r["device_copy"] == device_copy
    if device_copy:
        assert set(r["profile_ms_per_step"]) == {"plain", "protected"}
        assert "no device timeline" in run.stdout
    c = r["campaign"]
    # The trainer's default with snapshots: the gradients checked in the update.
    assert r["protection"]["gradient_checks"] == "in the update"
    if not device_copy:  # no double faults; every state fault from the other replica
        assert "double_fault" not in c["faults"]  # kinds with nothing injected are left out
        state_kinds = ("param_flip", "master_flip", "moment_flip", "row_burst")
        # A step with a non-finite gradient is applied in part: the host snapshot, each.
        assert c["host_restores"] == c["faults"]["grad_nonfinite"]["injected"]
        assert c["replica_repairs"] >= sum(c["faults"][k]["injected"] for k in state_kinds) > 0
    assert r["compiles_after_prewarm"] == 0 and r["campaign"]["bit_identical"]
    assert all(row["missed"] == 0 and row["repaired"] == row["injected"]
               for row in r["campaign"]["faults"].values())
    assert r["campaign"]["reference_incidents"] == 0


def test_llama3_tool_as_two_processes_with_fsdp(tmp_path):
    """`pimhbm llama3 --processes 2`: two processes (jax.distributed on localhost, gloo), two CPU
    devices each, 2 replicas x 2 shards: the timings and the campaign of every fault kind, ended
    bit-identical with no compilation after prewarm; process 0 writes the figures."""
    import json
    import subprocess
    import sys

    if jax.default_backend() != "cpu" and len(jax.devices()) < 4:
        pytest.skip("needs 4 GPUs here (elsewhere each process makes 2 CPU devices)")
    out = tmp_path / "llama3.json"
    cmd = [sys.executable, "-m", "pimhbm_cli", "llama3", "--tiny", "--layers", "1", "--tokens",
           "256", "--seq", "32", "--vocab", "256", "--steps", "2", "--devices", "4", "--shard",
           "2", "--processes", "2", "--campaign-steps", "6", "--faults", "1", "--json", str(out)]
    # Without the session's compilation cache (see conftest.py: not for multi-process runs).
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["devices"] == 4 and r["shard"] == 2 and r["processes"] == 2
    assert r["compiles_after_prewarm"] == 0 and r["campaign"]["bit_identical"]
    assert all(row["missed"] == 0 and row["repaired"] == row["injected"]
               for row in r["campaign"]["faults"].values())
    assert r["campaign"]["reference_incidents"] == 0


# -- a Hugging Face model directory: config.json, shards and their index -------------------------

def np_inv_freq(d, theta, scaling=None):
    """Llama 3.1's scaled rotary frequencies, written from its definition."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    if scaling is None:
        return inv
    factor, low, high, old = (scaling["factor"], scaling["low_freq_factor"],
                              scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
    out = []
    for f in inv:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def np_forward_hf(tensors, config, tokens):
    """Logits of a Hugging Face Llama checkpoint (tensors by their names, config.json's dict)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    inv = np_inv_freq(d, config["rope_theta"], config.get("rope_scaling"))
    eps = config["rms_norm_eps"]

    def rope(x):
        ang = np.arange(x.shape[0])[:, None] * inv[None, :]
        cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    w = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    outs = []
    for seq in tokens:
        x, t = w["model.embed_tokens.weight"][seq], len(seq)
        for i in range(config["num_hidden_layers"]):
            pre = f"model.layers.{i}."
            h = np_rms(x, w[pre + "input_layernorm.weight"], eps)
            q = rope((h @ w[pre + "self_attn.q_proj.weight"].T).reshape(t, heads, d))
            k = rope((h @ w[pre + "self_attn.k_proj.weight"].T).reshape(t, kv_heads, d))
            v = (h @ w[pre + "self_attn.v_proj.weight"].T).reshape(t, kv_heads, d)
            out = np.zeros((t, heads, d))
            for hd in range(heads):
                s = q[:, hd] @ k[:, hd // (heads // kv_heads)].T / np.sqrt(d)
                s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True))
                out[:, hd] = (p / p.sum(-1, keepdims=True)) @ v[:, hd // (heads // kv_heads)]
            x = x + out.reshape(t, -1) @ w[pre + "self_attn.o_proj.weight"].T
            h = np_rms(x, w[pre + "post_attention_layernorm.weight"], eps)
            g = h @ w[pre + "mlp.gate_proj.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * (h @ w[pre + "mlp.up_proj.weight"].T)) @ \
                w[pre + "mlp.down_proj.weight"].T
        head = w["lm_head.weight"] if not config["tie_word_embeddings"] else w["model.embed_tokens.weight"]
        outs.append(np_rms(x, w["model.norm.weight"], eps) @ head.T)
    return np.stack(outs)


def write_hf_directory(path, rng, config, shards=2):
    """A model directory as Hugging Face writes it: config.json, the weights split over shards
    and model.safetensors.index.json naming them."""
    import json

    from safetensors.numpy import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = hidden // heads
    tensors = {"model.embed_tokens.weight": (config["vocab_size"], hidden),
               "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        tensors |= {pre + "self_attn.q_proj.weight": (heads * d, hidden),
                    pre + "self_attn.k_proj.weight": (kv * d, hidden),
                    pre + "self_attn.v_proj.weight": (kv * d, hidden),
                    pre + "self_attn.o_proj.weight": (hidden, heads * d),
                    pre + "mlp.gate_proj.weight": (inter, hidden),
                    pre + "mlp.up_proj.weight": (inter, hidden),
                    pre + "mlp.down_proj.weight": (hidden, inter),
                    pre + "input_layernorm.weight": (hidden,),
                    pre + "post_attention_layernorm.weight": (hidden,)}
    tensors = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in tensors.items()}
    names = sorted(tensors)
    weight_map = {}
    for j in range(shards):
        file = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        part = names[j::shards]
        save_file({k: tensors[k] for k in part}, str(path / file))
        weight_map |= {k: file for k in part}
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return tensors


HF_CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
             "hidden_act": "silu",
             "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


@pytest.mark.parametrize("tied", [True, False])
def test_a_hugging_face_directory_loads_and_computes_what_its_definition_says(tmp_path, rng, tied):
    config = HF_CONFIG | {"tie_word_embeddings": tied}
    tensors = write_hf_directory(tmp_path, rng, config)
    params, cfg = llama3.load_hf(str(tmp_path), dtype="float32")
    assert cfg.tie_embeddings is tied and ("lm_head" in params) is not tied
    assert cfg.rope_scaling == llama3.RopeScaling(4.0, 1.0, 4.0, 64)
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab) == (4, 2, 16, 96)
    tokens = rng.integers(0, cfg.vocab, size=(2, 23)).astype(np.int32)
    got = np.asarray(llama3.forward(params, tokens, cfg))
    want = np_forward_hf(tensors, config, tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # Without the scaling the logits differ: the test sees the frequencies.
    plain = np_forward_hf(tensors, config | {"rope_scaling": None}, tokens)
    assert np.linalg.norm(got - plain) / np.linalg.norm(want) > 1e-3


def test_what_a_model_directory_may_not_say_is_refused_by_name(tmp_path, rng):
    import json
    write_hf_directory(tmp_path, rng, HF_CONFIG)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="shards must be .safetensors files in the model's directory"):
        llama3.load_hf(str(tmp_path))
    index.write_text(json.dumps(good))
    for bad, match in (({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
                       ({"model_type": "mistral"}, "not a Llama"),
                       ({"num_attention_heads": "4"}, "num_attention_heads must be int")):
        (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG | bad))
        with pytest.raises(ValueError, match=match):
            llama3.load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        llama3.load_hf(str(tmp_path))


def test_llama3_tool_measures_each_steps_memory_in_a_process_of_its_own():
    """`pimhbm llama3 --memory-of KIND` (the children the tool starts before it touches the
    GPU): the state each step carries between steps. Plain optax holds 14 bytes a parameter
    (bf16 parameters, fp32 master weights, mu, nu); the protected one copy at most 1.10x that."""
    import json
    import subprocess
    import sys

    figures = {}
    for kind in ("plain", "protected"):
        cmd = [sys.executable, "-m", "pimhbm_cli", "llama3", "--tiny", "--layers", "1",
               "--tokens", "256", "--seq", "32", "--vocab", "256", "--steps", "3", "--devices",
               "1", "--memory-of", kind]
        run = subprocess.run(cmd, capture_output=True, text=True, env=cached_env(), timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        line = next(l for l in run.stdout.splitlines() if l.startswith("MEMORY "))
        figures[kind] = json.loads(line[len("MEMORY "):])
    plain, protected = figures["plain"], figures["protected"]
    assert plain["params"] == protected["params"] > 0
    assert 14.0 <= plain["state_bytes"] / plain["params"] < 14.01  # optax's: and its count
    assert protected["state_bytes"] <= 1.10 * plain["state_bytes"]


def test_llama3_tool_takes_the_chunk_size_it_is_given():
    """`--chunk-elems` reaches the protected state (its digest rows, parity rows and stash are
    laid out for it: other bytes held at 256 than at 512); a size the state does not take stops
    the tool before it starts, saying which it takes, for either kind of state."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pimhbm_cli", "llama3", "--tiny", "--layers", "1", "--tokens",
           "256", "--seq", "32", "--vocab", "256", "--steps", "3", "--devices", "1",
           "--memory-of", "protected"]
    held = {}
    for chunk in ("256", "512"):
        run = subprocess.run(cmd + ["--chunk-elems", chunk], capture_output=True, text=True,
                             env=cached_env(), timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        line = next(l for l in run.stdout.splitlines() if l.startswith("MEMORY "))
        held[chunk] = json.loads(line[len("MEMORY "):])["state_bytes"]
    assert held["512"] != held["256"]
    run = subprocess.run(cmd + ["--chunk-elems", "300"], capture_output=True, text=True,
                         env=cached_env(), timeout=300)
    assert run.returncode == 2 and "--chunk-elems 300: the in-place update takes" in run.stderr
    run = subprocess.run(cmd + ["--state", "two-slots", "--chunk-elems", "300"],
                         capture_output=True, text=True, env=cached_env(), timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--chunk-elems 300 with --state two-slots: chunk_elems must be a positive" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("speculative", [False, True], ids=["gradients", "speculative"])
def test_llama3_tool_checks_where_it_is_told(tmp_path, speculative):
    """`--gradient-checks in-update`, and with it `--parameter-checks in-update` (no checks
    before the writes): the tiny tool's campaign of every fault kind still ends bit-identical
    with 0 compilations, its gradient faults restored from the host snapshot, and the figures
    say what was on; with two slots, without snapshots, or with the parameters alone checked
    in the update, the options are refused before anything starts."""
    import json
    import subprocess
    import sys

    out = tmp_path / "llama3.json"
    cmd = [sys.executable, "-m", "pimhbm_cli", "llama3", "--tiny", "--layers", "1", "--tokens",
           "256", "--seq", "32", "--vocab", "256", "--steps", "2", "--devices", "1",
           "--campaign-steps", "10", "--faults", "1", "--gradient-checks", "in-update"]
    where = "in-update" if speculative else "before-writes"
    run = subprocess.run(cmd + ["--parameter-checks", where, "--json", str(out)],
                         capture_output=True, text=True, env=cached_env(), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["protection"]["gradient_checks"] == "in the update"
    assert r["protection"]["parameter_checks"] == {"in-update": "in the update",
                                                   "before-writes": "before the writes"}[where]
    assert r["compiles_after_prewarm"] == 0 and r["campaign"]["bit_identical"]
    grads = r["campaign"]["faults"]["grad_nonfinite"]
    assert grads["missed"] == 0 and grads["repaired"] == grads["injected"] == 1
    if speculative:
        return  # the refusals below do not depend on it
    run = subprocess.run(cmd + ["--state", "two-slots"], capture_output=True, text=True,
                         env=cached_env(), timeout=300)
    assert run.returncode == 2 and "is for --state one-copy" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run(cmd + ["--snapshot-every", "0"], capture_output=True, text=True,
                         env=cached_env(), timeout=300)
    assert run.returncode == 2 and "--snapshot-every must be above 0" in run.stderr
    before = [w for w in cmd if w != "in-update"] + ["before-writes"]
    run = subprocess.run(before + ["--parameter-checks", "in-update"], capture_output=True,
                         text=True, env=cached_env(), timeout=300)
    assert run.returncode == 2 and "add --gradient-checks in-update" in run.stderr
    # Unset, the gradients' checks follow the trainer's default: in the update with snapshots
    # (the speculative checks accepted), before the writes without them (refused).
    alone = [w for w in cmd if w not in ("--gradient-checks", "in-update")]
    run = subprocess.run(alone + ["--snapshot-every", "0", "--parameter-checks", "in-update"],
                         capture_output=True, text=True, env=cached_env(), timeout=300)
    assert run.returncode == 2 and "needs host snapshots" in run.stderr
    assert "add --gradient-checks" not in run.stderr  # that alone would be refused next


def test_llama3_tool_times_exact_mode_in_a_process_of_its_own():
    """`pimhbm llama3 --exact-of-protected` (the child the tool starts, in exact mode, for the
    exact-mode row beside the fast plain step): one line with the protected step's time."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pimhbm_cli", "llama3", "--tiny", "--layers", "1", "--tokens",
           "256", "--seq", "32", "--vocab", "256", "--steps", "2", "--devices", "1",
           "--exact-of-protected"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=cached_env(), timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("EXACT "))
    assert json.loads(line[len("EXACT "):])["protected_ms"] > 0


def test_exact_mode_picks_an_attention_that_repeats_without_xla_flags():
    """GPUs: cuDNN's attention for speed; pimhbm's in exact mode where it takes the head dim
    (the tiny models' 16 too), XLA's (with the flag) where it does not; CPUs: XLA's, repeatable
    as it is."""
    from pimhbm_cli.llama3 import _attention

    big, tiny = llama3.llama3_8b(layers=1), llama3.tiny()
    odd = llama3.tiny(hidden=96)  # head dim 24: not one our kernels take
    assert _attention(big, "gpu", exact=False) == "cudnn"
    assert _attention(big, "gpu", exact=True) == llama3.PIMHBM_ATTENTION
    assert _attention(tiny, "gpu", exact=True) == llama3.PIMHBM_ATTENTION
    assert _attention(odd, "gpu", exact=True) == "xla"
    assert _attention(big, "cpu", exact=True) == "xla"


def test_xla_flag_is_set_only_where_our_attention_cannot_serve():
    """The CLI sets XLA's deterministic flag before JAX starts only where exact replays need it:
    the demo at a head dim our kernels do not take, and recover; never for the demo's default
    model or llama3's tiny one."""
    from pimhbm_cli import _needs_exact_replay, _parser

    parse = lambda *argv: _parser().parse_args(list(argv))
    assert not _needs_exact_replay(parse("demo"))
    assert _needs_exact_replay(parse("demo", "--hidden", "96"))
    assert not _needs_exact_replay(parse("llama3", "--tiny", "--deterministic"))
    assert not _needs_exact_replay(parse("llama3", "--tiny"))
    assert _needs_exact_replay(parse("recover"))


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_the_ordered_embedding_gradient_is_the_row_sums_in_a_fixed_order(rng, dtype):
    """ordered=True: the same rows forward; the gradient is each row's cotangents summed in
    float32 (np.add.at in float64 to float32 tolerance, then rounded to the table's dtype),
    unrepeated rows zero, and two calls agree bit for bit; on ragged token counts."""
    dtype = jnp.dtype(dtype)
    vocab, hidden = 2048, 24
    table = jnp.asarray(rng.standard_normal((vocab, hidden)), dtype)
    for shape in [(1, 1), (3, 37), (2, 500)]:
        tokens = jnp.asarray(rng.integers(0, 60, shape), jnp.int32)  # many repeats
        tokens = tokens.at[0, 0].set(vocab - 1)  # the last row too
        cot = jnp.asarray(rng.standard_normal(shape + (hidden,)), dtype)
        np.testing.assert_array_equal(llama3.embed(table, tokens, ordered=True), table[tokens])
        grad = jax.jit(jax.grad(lambda t: jnp.sum(
            llama3.embed(t, tokens, ordered=True).astype(jnp.float32) * cot.astype(jnp.float32))))
        got = grad(table)
        want = np.zeros((vocab, hidden))
        np.add.at(want, np.asarray(tokens).reshape(-1),
                  np.asarray(cot, np.float64).reshape(-1, hidden))
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
        assert np.asarray(got).tobytes() == np.asarray(grad(table)).tobytes()
        unused = np.setdiff1d(np.arange(vocab), np.asarray(tokens))
        assert not np.asarray(got, np.float64)[unused].any()
