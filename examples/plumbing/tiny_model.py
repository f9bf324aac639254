"""Tiny random-weight Qwen2 checkpoints built offline, for tests, examples and benchmarks.

No model hub is reachable in CI, so every test builds its own checkpoint: a Qwen2 config,
random weights drawn from a seed (bf16 unless the spec says otherwise), and a byte-level BPE
tokenizer trained on a fixed synthetic corpus. The same spec with two seeds gives "old" and
"new" weights of identical shape, which is what an RL weight swap needs. Checkpoints are cached
on disk under a key of the spec.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
_BUILDER_VERSION = 2  # bump when the on-disk format or the weight recipe changes


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny Qwen2 checkpoint; ``head_dim = hidden_size // num_heads``.

    The CPU attention kernel rejects head_dim 16, so the default keeps it at 64.
    """

    seed: int = 1
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    # Std of the output head; larger than the usual 0.02 so greedy argmax has clear margins
    # and stays stable across batch shapes on CPU kernels.
    lm_head_std: float = 0.25
    weight_std: float = 0.05
    dtype: str = "bfloat16"  # stored in the checkpoint; servers and trainers load it as stored
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def key(self) -> str:
        payload = {k: v for k, v in asdict(self).items() if k != "extra"}
        payload["builder"] = _BUILDER_VERSION
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        return f"qwen2-l{self.num_layers}-h{self.hidden_size}-s{self.seed}-{digest[:12]}"

    def num_parameters(self) -> int:
        return sum(_numel(shape) for _, shape in parameter_shapes(self))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_ASCEND_RL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "vllm_ascend_rl"


def parameter_shapes(spec: TinyModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint-format (Hugging Face) parameter names and shapes of a Qwen2 causal LM."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab_size, h))]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (spec.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (spec.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, spec.intermediate_size)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (spec.vocab_size, h))]
    return out


def _synthetic_corpus() -> list[str]:
    """A fixed pseudo-text: Python's seeded ``random`` is stable across versions."""
    rng = random.Random(20261129)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "ing", "er", " "]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    lines += ["The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()[]{}<>,;:!?'\""]
    return lines


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    return tok


def _write_config(path: Path, spec: TinyModelSpec, vocab_size: int, eos_id: int) -> None:
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": spec.dtype,
        "dtype": spec.dtype,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id})
    )


def random_weights(spec: TinyModelSpec, vocab_size: int | None = None):
    """Deterministic weights for ``spec``, in its dtype; each tensor has its own generator, so the
    values of one tensor do not depend on the order or number of the others."""
    import torch

    vocab = vocab_size or spec.vocab_size
    tensors = {}
    for index, (name, shape) in enumerate(parameter_shapes(spec)):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shape = (vocab, shape[1])
        gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = spec.lm_head_std * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        else:
            t = spec.weight_std * torch.randn(shape, generator=gen)
        tensors[name] = t.to(getattr(torch, spec.dtype)).contiguous()
    return tensors


def build_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the checkpoint for ``spec``, building it on first use.

    The build goes to a temporary directory that is renamed into place, so concurrent
    builders (parallel test processes) never see a half-written checkpoint.
    """
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / spec.key()
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        tok = _build_tokenizer(spec.vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        vocab_size = tok.get_vocab_size()
        eos_id = tok.token_to_id(EOS_TOKEN)
        _write_config(tmp, spec, vocab_size, eos_id)
        save_file(
            random_weights(spec, vocab_size),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        try:
            tmp.rename(target)
        except OSError:  # another builder won the race
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_model_pair(
    spec: TinyModelSpec | None = None,
    old_seed: int = 1,
    new_seed: int = 2,
    cache_dir: Path | None = None,
) -> tuple[Path, Path]:
    """Two checkpoints of identical shape and tokenizer: "old" (v1) and "new" (v2) weights."""
    from dataclasses import replace

    spec = spec or TinyModelSpec()
    return (
        build_tiny_model(replace(spec, seed=old_seed), cache_dir),
        build_tiny_model(replace(spec, seed=new_seed), cache_dir),
    )


def load_hf_model(path: Path | str):
    """Load a checkpoint as a Hugging Face module (what a trainer holds), on CPU, in the
    checkpoint's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto").eval()
    # from_pretrained maps the safetensors file; a trainer's parameters live in ordinary
    # (anonymous, huge-page backed) memory, which copies ~1.7x faster than file pages.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model
