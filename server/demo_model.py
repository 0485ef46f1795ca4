"""Builds small random-weight Hugging Face checkpoints with a real tokenizer.

No model hub is reachable from our machines, so the demo and the tests make their own
checkpoints: transformers' config and model classes write ``config.json`` and
safetensors; the tokenizer is Mistral's 32k SentencePiece model shipped inside the
``mistral-common`` package, converted to ``tokenizer.json``; a chat template is added.
Large-vocabulary checkpoints (the 128k Llama-3.1 shapes) take Mistral's 131k Tekken
tokenizer from the same package instead, so that every token id they sample decodes.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvscale.server.config import parse_dtype

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Architecture name -> (transformers config class, model class) names.
_ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}

SIZES: dict[str, dict[str, Any]] = {
    # For tests: fast on 2 CPU cores.
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
    # For `kvscale serve --model demo` on a CPU.
    "demo": dict(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
}


def _mistral_data_file(name: str) -> Path:
    # Located without importing mistral_common (whose imports we do not need).
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the demo tokenizer needs the mistral-common package installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"mistral-common does not ship {path.name} at {path}")
    return path


TOKENIZERS = ("sentencepiece", "tekken")


def write_tokenizer(out_dir: str | Path, kind: str = "sentencepiece") -> None:
    """Writes tokenizer.json + tokenizer_config.json with the chat template.

    ``kind``: "sentencepiece" (Mistral's 32k vocabulary) or "tekken" (Mistral's 131k
    byte-level BPE); both add BOS (id 1) to encoded text, EOS is id 2."""
    if kind == "sentencepiece":
        from tokenizers.models import BPE
        from transformers import LlamaTokenizer
        from transformers.convert_slow_tokenizer import SentencePieceExtractor

        parts = SentencePieceExtractor(str(_mistral_data_file("tokenizer.model.v1"))).extract(BPE)
        tok = LlamaTokenizer(
            vocab=parts["vocab"], merges=parts["merges"], add_bos_token=True, add_eos_token=False
        )
        tok.chat_template = CHAT_TEMPLATE
    elif kind == "tekken":
        from tokenizers import processors
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(
            tokenizer_object=tekken_tokenizer(_mistral_data_file("tekken_240911.json")),
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            chat_template=CHAT_TEMPLATE,
        )
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)]
        )
    else:
        raise ValueError(f"tokenizer: {kind!r} is not one of {TOKENIZERS}")
    tok.save_pretrained(str(out_dir))


def tekken_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` for a Mistral ``tekken.json``: byte-level BPE whose ranks
    become ids after ``default_num_special_tokens`` special tokens (``<unk>``, ``<s>``,
    ``</s>``, then placeholders), merges recovered from the ranks as tiktoken converters
    do. Built here rather than through transformers' Mistral integration, which imports
    mistral-common and all its dependencies."""
    import base64
    import json as _json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    raw = _json.loads(Path(path).read_text(encoding="utf-8"))
    cfg = raw["config"]
    n_special = cfg["default_num_special_tokens"]
    ranks = [
        base64.b64decode(t["token_bytes"])
        for t in raw["vocab"][: cfg["default_vocab_size"] - n_special]
    ]
    rank_of = {b: r for r, b in enumerate(ranks)}
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, n_special)]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({text(b): r + n_special for r, b in enumerate(ranks)})
    merges: list[tuple[str, str]] = []
    for b in ranks:  # in rank order: the merges that can build each token, cheapest first
        pairs = [(b[:k], b[k:]) for k in range(1, len(b)) if b[:k] in rank_of and b[k:] in rank_of]
        pairs.sort(key=lambda p: (rank_of[p[0]], rank_of[p[1]]))
        merges.extend((text(x), text(y)) for x, y in pairs)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(cfg["pattern"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return tok


def build_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    dtype: str = "float32",
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    max_shard_size: str | None = None,
    tie_word_embeddings: bool | None = None,
    init_std: float = 0.08,
    **overrides: Any,
) -> Path:
    """Writes a random-weight checkpoint to ``out_dir`` and returns its path.

    ``arch``: llama | mistral | qwen2. ``size``: a key of SIZES. ``rope_scaling``: e.g.
    ``{"rope_type": "llama3", "factor": 8.0, ...}``. ``max_shard_size`` (e.g. "2MB")
    writes sharded safetensors with an index file. ``init_std`` is larger than
    transformers' default so that random models have decisive (non-tied) argmaxes.
    """
    import transformers

    if arch not in _ARCHES:
        raise ValueError(f"arch: {arch!r} is not one of {sorted(_ARCHES)}")
    if size not in SIZES:
        raise ValueError(f"size: {size!r} is not one of {sorted(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    cfg_cls_name, model_cls_name = _ARCHES[arch]
    kwargs: dict[str, Any] = dict(SIZES[size])
    kwargs.update(
        vocab_size=32000,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    if arch == "qwen2":
        kwargs["tie_word_embeddings"] = True
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if rope_scaling is not None:
        kwargs["rope_scaling"] = {**rope_scaling, "rope_theta": kwargs["rope_theta"]}
    kwargs.update(overrides)
    config = getattr(transformers, cfg_cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(parse_dtype(dtype))
    model.eval()
    save_kwargs: dict[str, Any] = {}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **save_kwargs)
    return out


def default_cache_dir() -> Path:
    base = os.environ.get("KVSCALE_CACHE") or Path.home() / ".cache" / "kvscale"
    return Path(base)


def demo_model_path(size: str = "demo") -> Path:
    """Returns the built-in demo checkpoint, building it on first use (a few seconds).

    Safe when several processes start on an empty cache at once (servers started
    together): each builds into a folder of its own and renames it into place; the
    first rename wins, the others drop their copy, and nobody removes a finished one."""
    path = default_cache_dir() / f"demo-llama-{size}-v1"
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_checkpoint(tmp, arch="llama", size=size, dtype="float32", seed=0)
    try:
        tmp.rename(path)
    except OSError:  # the folder exists: another process finished first, or a stale one
        if (path / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return path
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path


def write_random_checkpoint(
    out_dir: str | Path,
    arch: str,
    config_kwargs: dict[str, Any],
    dtype: str = "bfloat16",
    device: str = "cpu",
    std: float = 0.02,
    seed: int = 0,
    shard_bytes: int = 4 << 30,
    tokenizer: str = "sentencepiece",
) -> Path:
    """Writes a large random-weight checkpoint without building the model in memory.

    Parameter names and shapes come from transformers' model class on the meta device;
    each tensor is drawn N(0, std) on ``device`` (fast on a GPU), cast to ``dtype`` and
    written into safetensors shards of about ``shard_bytes`` with an index file. Norm
    weights are ones, as in a freshly initialised model. Used for the 8B-shaped
    benchmark model, where initialising through transformers would take minutes.
    ``tokenizer``: see ``write_tokenizer``.
    """
    import json as _json

    import transformers
    from safetensors.torch import save_file

    if arch not in _ARCHES:
        raise ValueError(f"arch: {arch!r} is not one of {sorted(_ARCHES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, tokenizer)
    cfg_cls_name, model_cls_name = _ARCHES[arch]
    config = getattr(transformers, cfg_cls_name)(**config_kwargs)
    config.torch_dtype = dtype
    config.architectures = [model_cls_name]
    config.save_pretrained(str(out))
    with torch.device("meta"):
        shapes = {
            name: tuple(p.shape)
            for name, p in getattr(transformers, model_cls_name)(config).state_dict().items()
        }
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = parse_dtype(dtype)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_size = 0
    shards: list[dict[str, torch.Tensor]] = []

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            shards.append(shard)
            idx = len(shards)
            name = f"model-{idx:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shards[-1] = {}
        shard, shard_size = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch_dtype)
        else:
            t = torch.empty(shape, device=device, dtype=torch.float32)
            t.normal_(0.0, std, generator=gen)
            t = t.to(torch_dtype).cpu()
        shard[name] = t
        shard_size += t.numel() * t.element_size()
        if shard_size >= shard_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(_json.dumps(index, indent=2))
    return out
