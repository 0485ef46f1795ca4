"""The demo tokenizers: the 131k Tekken one matches transformers' own conversion."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from kvscale.server.demo_model import _mistral_data_file, write_tokenizer
from kvscale.server.tokenizer import load_tokenizer


def test_tekken_matches_transformers_conversion(tmp_path: Path) -> None:
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    write_tokenizer(tmp_path, "tekken")
    ours = load_tokenizer(tmp_path)
    ref = convert_tekken_tokenizer(str(_mistral_data_file("tekken_240911.json")))
    assert len(ours) == len(ref) == 131072
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    rng = random.Random(0)
    texts = ["Hello world, how are you? Ünïcödé 😀", "def f(x):\n    return x**2\n", "日本語と中文"]
    for _ in range(50):
        texts.append("".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 40))))
    for t in texts:
        ids = ours.encode(t, add_special_tokens=False)
        assert ids == ref.encode(t, add_special_tokens=False)
        assert ours.decode(ids) == t
        assert ours.encode(t)[0] == 1  # BOS added to encoded text, as Llama 3's tokenizer does
    ids = [rng.randrange(0, 128256) for _ in range(2000)]
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_tekken_needs_no_mistral_common_import(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import sys\n"
        "from kvscale.server.demo_model import write_tokenizer\n"
        f"write_tokenizer({str(tmp_path)!r}, 'tekken')\n"
        "assert 'mistral_common' not in sys.modules, 'mistral_common was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_unknown_tokenizer_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        write_tokenizer(tmp_path, "wordpiece")
