"""A registry entry's weights: the check that they are there (`ensure_model_files`, run by the
engine before it starts), and the local recipe an entry may name as its `builder`.

The one recipe, `tiny-llama`: a Llama-architecture model with random weights and a locally
trained tokenizer.

No download happens: the tokenizer is a byte-level BPE trained on generated text, the weights are
random with a fixed seed, so two builds of the same version produce the same files. The shape
follows docs/field-notes.md (head_dim 32: vLLM's CPU attention refuses smaller heads at the first step).
Needs the `cpu` or `gpu` extra (torch + transformers).
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from app.errors import MODEL_NOT_FOUND, RequestError
from app.requests.models import TINY_LLAMA
from app.requests.models import TINY_MAX_POSITIONS as MAX_POSITIONS
from app.requests.models import TINY_VERSION
from app.requests.models import TINY_VOCAB_SIZE as VOCAB_SIZE
from app.requests.models import ModelSpec

_MARKER = "vigil-tiny.json"
_WORDS = (
    "the a an one two three red blue green small large quick slow cat dog bird fish tree river "
    "mountain city house road car train ship sun moon star cloud rain snow wind fire water stone "
    "gold silver book page word letter song voice light dark day night morning evening year time "
    "runs jumps sings reads writes sees hears finds makes takes gives builds opens closes carries "
    "and or but with without under over near far into from to of in on at by for is was are were "
    "hello world model prompt token answer question story list number table chair window door "
    "Alice Bob Carol Dave Eve Paris London Tokyo river-bank half-past forty-two 1 2 3 10 42 100"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", ":"]))
    return out


def is_built(path: str | os.PathLike) -> bool:
    """True when `path` holds a complete tiny-llama of the current recipe version."""
    marker = Path(path) / _MARKER
    try:
        return json.loads(marker.read_text()).get("version") == TINY_VERSION
    except (OSError, ValueError):
        return False


def ensure_tiny_llama(path: str | os.PathLike) -> Path:
    """Build tiny-llama into `path` unless a current build is there. Safe when several workers
    share a cache dir: builders take an exclusive file lock, and a waiter re-checks after it."""
    dest = Path(path)
    if is_built(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(dest):
            build_tiny_llama(dest)
    return dest


def build_tiny_llama(path: str | os.PathLike, seed: int = 0, hidden_size: int = 128) -> Path:
    """Build tiny-llama into `path` (created; replaced atomically if it exists) and return it.

    The directory is written under a temporary name and renamed into place, so a crash mid-build
    never leaves a half-written model that a worker would try to load. `hidden_size` (4 heads:
    head_dim = hidden_size / 4) builds a wider variant, e.g. 512 for head_dim 128, the head size
    every GPU attention backend takes (bench/gpu_check.py); the built-in model is 128.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dest = Path(path).resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        special = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(seed), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            model_max_length=MAX_POSITIONS,
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)

        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=MAX_POSITIONS,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / _MARKER).write_text(json.dumps({"version": TINY_VERSION, "seed": seed}))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def build_if_local(spec: ModelSpec) -> None:
    """Build a model whose registry entry names a local recipe (`builder`), unless a current
    build is already at its path; nothing for any other model."""
    if spec.builder == TINY_LLAMA:
        ensure_tiny_llama(spec.path)


def ensure_model_files(spec: ModelSpec) -> str:
    """The local path of the model's weights, building a locally-built model on first use.

    Raises RequestError(model_not_found) at once, naming the path, when a registered path is
    missing (vLLM would say the same less plainly, as an HFValidationError).
    """
    build_if_local(spec)
    if spec.path and not os.path.exists(spec.path):
        raise RequestError.of(MODEL_NOT_FOUND, f"model {spec.name}: no weights at {spec.path}")
    return spec.path or spec.name
