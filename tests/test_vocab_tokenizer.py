"""The synthesized full-vocabulary tokenizer (benchmarks/vocab_tokenizer.py) and the random checkpoints that carry it
(benchmarks/make_random_checkpoint.py): exact size and Llama 3 layout, text for every id, merges a trained BPE could
have (what llguidance's forced tokens rely on), the engine's tokenizer, detokenizer, chat template and grammar masks
over it, and a small-bodied 128,256-vocabulary checkpoint generating through engine.LLM."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import llguidance
import pytest
import torch
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer

from benchclient.workload import WORDS
from benchmarks.make_random_checkpoint import PRESETS, preset_shape, tensor_shapes, write_checkpoint
from benchmarks.vocab_tokenizer import build_tokenizer, special_ids
from engine import LLM, SamplingParams
from engine.sampling.grammar import GrammarManager
from engine.sampling.structured import StructuredSpec
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer
from tests.json_schemas import random_instance, random_schema

N = 128256
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=N, tie_word_embeddings=False)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|eot_id|> there 😀"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small-bodied random checkpoint with Llama 3's vocabulary, in 8 MB shards (embedding and head alone)."""
    path = tmp_path_factory.mktemp("vocab") / "small-128k"
    write_checkpoint(path, SMALL, shard_bytes=8 << 20)
    return path


@pytest.fixture(scope="module")
def backend(folder: Path) -> Backend:
    return Backend.from_file(str(folder / "tokenizer.json"))


def random_text(rng: random.Random) -> str:
    alphabet = "abc xyz THE the. ,!?\n\t\r'\"{}[]:0123456789éßλж日本語😀👍中文<|>_-"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))


@pytest.mark.parametrize("size", [3000, N])
def test_exactly_the_vocab_size_with_llama3_specials_at_the_top(size, backend):
    tok = backend if size == N else build_tokenizer(size)
    assert tok.get_vocab_size(with_added_tokens=True) == size
    assert len(set(tok.get_vocab(with_added_tokens=True).values())) == size
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(size))
    ids = special_ids(tok)
    assert (ids.bos, ids.eos, ids.eot) == (size - 256, size - 255, size - 247)
    assert tok.id_to_token(size - 250) == "<|start_header_id|>" and tok.id_to_token(size - 1).startswith("<|reserved")
    assert {i for i, t in tok.get_added_tokens_decoder().items() if t.special} == set(range(size - 256, size))
    if size != N:
        assert tok.to_str() == build_tokenizer(size).to_str()  # seeded: the same file every time
    with pytest.raises(ValueError, match="below 256 byte tokens"):
        build_tokenizer(500)


def test_every_id_decodes_to_text(backend):
    texts = backend.decode_batch([[i] for i in range(N)], skip_special_tokens=False)
    assert all(texts)
    assert texts[:128] == [chr(b) for b in range(128)]
    merged = texts[256:N - 256]
    assert not [t for t in merged if "\ufffd" in t]  # whole characters: a stream never waits on a merged token
    assert len(set(merged)) == len(merged)
    assert 4 < sum(len(t.encode()) for t in merged) / len(merged) < 8  # bytes a token, as real 128k vocabularies


def test_every_token_is_what_the_merges_make_of_it(backend):
    """Without the whole-word shortcut (ignore_merges) each token's own text still merges into exactly it: llguidance
    tokenizes forced text that way and masks any other token, so an unreachable token would be refused mid-stream."""
    spec = json.loads(backend.to_str())
    spec["model"]["ignore_merges"] = False
    strict = Backend.from_str(json.dumps(spec))
    pieces = {i: s for s, i in spec["model"]["vocab"].items()}
    assert [i for i in range(N - 256) if [t.id for t in strict.model.tokenize(pieces[i])] != [i]] == []


def test_round_trip_and_about_a_token_per_english_word(backend):
    rng = random.Random(0)
    for _ in range(300):
        text = random_text(rng)
        assert backend.decode(backend.encode(text, add_special_tokens=False).ids) == text
    assert backend.encode("hello").ids[0] == special_ids(backend).bos
    prompt = " ".join(rng.choice(WORDS) for _ in range(500))  # the benchmark client's text prompts
    assert len(backend.encode(prompt, add_special_tokens=False).ids) <= 525


def test_engine_tokenizer_loads_it_as_transformers_does(folder):
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert ours.vocab_size == len(theirs) == config["vocab_size"] == N
    assert ours.bos_token_id == config["bos_token_id"] and [ours.eos_token_id] == config["eos_token_id"][1:]
    rng = random.Random(1)
    for text in [random_text(rng) for _ in range(50)]:
        assert ours.encode(text) == theirs(text)["input_ids"]
    rendered = ours.apply_chat_template(CHAT)
    assert rendered == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = ours.encode_chat(CHAT)
    bos, start, end, eot = (N - 256, N - 250, N - 249, N - 247)
    assert ids[:2] == [bos, start] and ids.count(eot) == 2 and ids.count(end) == 3
    assert ours.decode(ids, skip_special_tokens=False) == rendered  # the typed "<|eot_id|>" stays text
    assert ids.count(eot) < ours.encode(rendered, add_special_tokens=False).count(eot)


def test_detokenizer_streams_text_for_every_sampled_id(folder):
    tok = Tokenizer.from_folder(folder)
    rng = random.Random(2)
    output = [rng.randrange(256, N - 256) for _ in range(400)]  # what a random model samples, bar 0.4%
    detok = IncrementalDetokenizer(tok, tok.encode("Once upon a time"))
    deltas = [detok.step([t]) for t in output]
    assert all(deltas)  # every token is a streamed chunk: inter-token latency is measurable
    assert "".join(deltas) + detok.flush() == tok.decode(output)


def test_grammar_matcher_over_the_exact_vocabulary(folder):
    tok = Tokenizer.from_folder(folder)
    gm = GrammarManager(tok.to_json(), N, [N - 255, N - 247], torch.device("cpu"), 1)
    assert gm.tokenizer.vocab_size == N
    with pytest.raises(ValueError, match="vocab size too small"):
        llguidance.LLTokenizer(tok.to_json(), n_vocab=N - 1)
    rng = random.Random(4)
    for n in range(8):  # each row steps through a valid document's own tokens: every one must be allowed
        schema = json.loads(json.dumps(random_schema(rng), sort_keys=True))  # properties in StructuredSpec's order
        document = json.dumps(random_instance(rng, schema), separators=(",", ":"))
        gm.attach("r", gm.make("r", StructuredSpec.json_schema(schema), []), 0)
        for i, token in enumerate(tok.encode(document, add_special_tokens=False)):
            logits = torch.zeros(1, N)
            gm.constrain([SimpleNamespace(request_id="r", output_index=i, incarnation=0)], logits, None)
            assert torch.isfinite(logits[0, token]), f"schema {n}: token {token} masked at {i} of {document!r}"
            assert torch.isinf(logits[0]).any()
            gm.advance("r", i, token)
        assert gm.finish_reason("r") == "stop"
        gm.drop("r")


def test_random_checkpoint_loads_and_generates_through_llm(folder):
    config = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and config["eos_token_id"] == [N - 255, N - 247]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    assert llm.engine.model_config.vocab_size == N and llm.engine.model_config.eos_token_ids == (N - 255, N - 247)
    out = llm.generate("The old lighthouse", SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.text == llm.tokenizer.decode(out.token_ids) and out.text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"], "additionalProperties": False}
    params = SamplingParams(seed=5, max_tokens=64, structured=StructuredSpec.json_schema(schema))
    reply = llm.chat([CHAT], params)[0]
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.text), schema)


def test_make_random_checkpoint_refuses_a_folder_with_weights(folder):
    with pytest.raises(FileExistsError, match="already holds weights"):
        write_checkpoint(folder, SMALL)


@pytest.mark.parametrize("preset,params", [("llama-3.2-1b", 1.236e9), ("llama-3-8b", 8.030e9),
                                           ("llama-3-70b", 70.554e9)])
def test_presets_have_the_published_parameter_counts(preset, params):
    total = sum(math.prod(dims) for _, dims in tensor_shapes(PRESETS[preset]))
    assert abs(total - params) / params < 1e-3


def test_layers_option_keeps_the_shape_with_fewer_layers(tmp_path):
    """`--layers N`: the preset's every width with N decoder layers (a 70B layer on a card the 70B does not fit);
    a count below 1 is refused by name."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "make_random_checkpoint.py"
    run = subprocess.run([sys.executable, str(script), "llama-3-70b", str(tmp_path / "l70b"), "--no-weights",
                          "--fp8", "channel", "--layers", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads((tmp_path / "l70b" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert {k: config[k] for k in PRESETS["llama-3-70b"] if k != "num_hidden_layers"} == {
        k: v for k, v in PRESETS["llama-3-70b"].items() if k != "num_hidden_layers"}
    assert config["quantization_config"]["config_groups"]
    assert preset_shape("llama-3-70b") == PRESETS["llama-3-70b"]
    with pytest.raises(ValueError, match="--layers must be at least 1"):
        preset_shape("llama-3-70b", 0)
