"""Bad input gives a clear error and never disturbs the other requests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError


def test_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a directory"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        LLM(str(tmp_path), device="cpu")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(llama_ckpt: Path, tmp_path: Path) -> None:
    path = _copy(llama_ckpt, tmp_path / "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(path), device="cpu")


def test_missing_tensor(llama_ckpt: Path, tmp_path: Path) -> None:
    path = _copy(llama_ckpt, tmp_path / "broken")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        LLM(str(path), device="cpu")


def test_wrong_tensor_shape(llama_ckpt: Path, tmp_path: Path) -> None:
    path = _copy(llama_ckpt, tmp_path / "shape")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape"):
        LLM(str(path), device="cpu")


def test_no_weights(llama_ckpt: Path, tmp_path: Path) -> None:
    path = _copy(llama_ckpt, tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        LLM(str(path), device="cpu")


@pytest.fixture(scope="module")
def llm(llama_ckpt: Path) -> LLM:
    return LLM(str(llama_ckpt), device="cpu", max_model_len=64)


def test_bad_prompts_rejected_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt has 64 tokens.*max_model_len is 64"):
        llm.generate([[1] + [5] * 63])
    with pytest.raises(ValueError, match="must not be empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 32000\)"):
        llm.generate([[1, 99999]])
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])
    assert not llm.engine.has_unfinished_requests()


def test_engine_keeps_serving_after_bad_request(llm: LLM) -> None:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(["one", "two"], params)]
    eng.add_request("a", "one", params)
    eng.add_request("b", "two", params)
    eng.step()
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("bad", [1] * 100, params)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", "again", params)
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request("c", "x", SamplingParams(stop_token_ids=[40000]))
    done = {}
    for _ in range(20):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not eng.has_unfinished_requests():
            break
    assert done == {"a": expected[0], "b": expected[1]}
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_abort_frees_blocks_and_keeps_others(llm: LLM) -> None:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("keep", "keep going", params)
    eng.add_request("drop", "please stop " * 5, params)
    eng.step()
    used = eng.block_manager.num_blocks - eng.block_manager.num_free_blocks
    assert eng.stats().num_running == 2
    assert eng.abort_request("drop")
    assert not eng.abort_request("drop")
    assert eng.block_manager.num_blocks - eng.block_manager.num_free_blocks < used
    assert eng.stats().num_running == 1
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.stats().finished.get("abort", 0) >= 1


def test_timestamps_and_counts(llm: LLM) -> None:
    eng = llm.engine
    before = eng.stats()
    eng.add_request("t", [1, 2000, 3000], SamplingParams(max_tokens=4, ignore_eos=True))
    assert eng.stats().num_waiting == 1
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    m = outs[-1].metrics
    assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"]
    assert m["first_token_time"] <= m["finished_time"]
    assert m["num_prompt_tokens"] == 3 and m["num_generation_tokens"] == 4
    after = eng.stats()
    assert after.prompt_tokens - before.prompt_tokens == 3
    assert after.generation_tokens - before.generation_tokens == 4
    assert after.finished["length"] - before.finished.get("length", 0) == 1


def test_bad_engine_settings(llama_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(llama_ckpt), device="cpu", block_size=7)
    with pytest.raises(ValueError, match="max_model_len=5000 is larger"):
        LLM(str(llama_ckpt), device="cpu", max_model_len=5000)
    with pytest.raises(ValueError, match="KV cache holds 32 tokens"):
        LLM(str(llama_ckpt), device="cpu", num_kv_blocks=2)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(llama_ckpt), device="cpu", dtype="int8")
