"""Each family's real chat template through the server: the templates llama.cpp keeps in
its source tree (models/templates, from the pinned llama-cpp-python sdist: ``make
converter``), each in a tiny model of its family on the torch runtime (GGUF files with it
as ``tokenizer.chat_template``, Hugging Face folders with it as chat_template.jinja),
served in-process. Over HTTP: /v1/chat/completions and /tokenize render a conversation to
the very tokens transformers' ``apply_chat_template`` does with the same template; with
``tools``, a history holding an assistant's calls and a tool result too (the template's own
tool syntax where it has one, else the server's fallback, which this test writes out by
hand); ``--tool-call-parser auto`` picks the family's parser, and a call written in the
family's syntax comes back as an OpenAI tool call, whole and streamed.

llama.cpp's tree has no template of Gemma 3 (recorded in tests/templates instead), OLMo 2,
OLMoE or Mixtral (those three are not here)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from superfluid.engine.async_engine import AsyncEngine
from superfluid.engine.config import EngineConfig
from superfluid.engine.loader import build_engine
from superfluid_testing.tiny import TinyModel, write_hf_folder
from superfluid.server.openai import create_app
from superfluid.server.tool_models import Tool
from superfluid.server.tool_parser import open_stream, whole
from superfluid.server.toolcalls.registry import resolve
from superfluid.server.tools import call_block, fallback_system_text, plan_tools
from test_architectures import write_family
from test_tool_parsers import replay

TEMPLATES = Path(sys.executable).parent.parent / "llama.cpp" / "models" / "templates"
RECORDED = Path(__file__).parent / "templates"  # the families llama.cpp's tree lacks (README.md there)
CONTEXT = 4096  # the tiny vocabulary spells a template's markers byte by byte: ~1500 tokens with tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "The city"}}, "required": ["city"]}}}
ROME = ("get_weather", {"city": "Rome"})
HERMES_CALL = ("Let me look.\n", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')

# family -> (llama.cpp's template, the model: "gguf:ARCH" a tiny GGUF, "hf:TYPE" a Llama-weights
# folder of that model type, else test_architectures' folder of the family; the parser auto
# picks (None: the template has no tool syntax, so the fallback, which asks for Hermes'
# blocks); (content, a call) as the family writes them)
FAMILIES = {
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "gguf:llama", "llama3_json",
               ("", '{"name": "get_weather", "parameters": {"city": "Rome"}}')),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "hf:mistral", "mistral",
                ("", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "a1b2c3d4e"}]')),
    "qwen2": ("Qwen-Qwen2.5-7B-Instruct.jinja", "gguf:qwen2", "hermes", HERMES_CALL),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "qwen3", "hermes", ("<think>\nThe weather tool.\n</think>\n\n", HERMES_CALL[1])),
    "qwen3_moe": ("Qwen-Qwen3-0.6B.jinja", "qwen3_moe", "hermes", HERMES_CALL),
    "gemma2": ("google-gemma-2-2b-it.jinja", "gemma2", None, HERMES_CALL),
    "gemma3_text": ("google-gemma-3-it.jinja", "gemma3_text", None, HERMES_CALL),  # recorded: tests/templates
    "phi3": ("microsoft-Phi-3.5-mini-instruct.jinja", "phi3", None, HERMES_CALL),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", "smollm3", None, HERMES_CALL),  # llama.cpp's copy has no tools
    "granite": ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite", "granite",
                ("I will check.", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}]')),
}

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Weather in Rome?"}]
# on the wire (arguments a JSON string) and as transformers' users write it (a mapping)
HISTORY = [{"role": "user", "content": "Weather in Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call9abcd", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "call9abcd", "content": "sunny, 24 C"}]
HF_HISTORY = [HISTORY[0],
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call9abcd", "type": "function", "function": {
                  "name": "get_weather", "arguments": {"city": "Rome"}}}]},
              HISTORY[2]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    if not TEMPLATES.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's chat templates are missing from {TEMPLATES} (make converter)")
        pytest.skip(f"llama.cpp's chat templates are not installed in {TEMPLATES} (make converter)")
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("family-templates")
    TinyModel().write_gguf(d / "t.gguf")
    AutoTokenizer.from_pretrained(d, gguf_file="t.gguf").save_pretrained(d / "tok")
    return d


def write_model(base: Path, family: str) -> tuple[Path, object]:
    """The family's tiny model holding its template, and transformers' tokenizer of it."""
    from transformers import AutoTokenizer

    template_file, model, _, _ = FAMILIES[family]
    template = ((RECORDED if (RECORDED / template_file).is_file() else TEMPLATES) / template_file).read_text()
    if model.startswith("gguf:"):
        path = TinyModel(arch=model[5:], context=CONTEXT, chat_template=template).write_gguf(base / f"{family}.gguf")
        return path, AutoTokenizer.from_pretrained(base, gguf_file=path.name)
    if model.startswith("hf:"):
        path = write_hf_folder(base / "t.gguf", base / family, model_type=model[3:], sliding_window=8,
                                max_position_embeddings=CONTEXT)
        for f in (base / "tok").iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    else:
        path = write_family(model, base / family, base / "tok")
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": CONTEXT}))
    (path / "chat_template.jinja").write_text(template)
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def served(base):
    """family -> (a client of its server, transformers' tokenizer, the engine's tokenizer), built once."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            path, hf = write_model(base, family)
            engine = build_engine(EngineConfig(model=str(path), quant="none", dtype="float32", kv_cache_mb=4))
            assert engine.config.runtime == "torch", engine.config
            client = TestClient(create_app(AsyncEngine(engine), model_name="m", web_ui=False))
            client.__enter__()
            made[family] = (client, hf, engine.tokenizer)
        return made[family]

    yield get
    for client, _, _ in made.values():
        client.__exit__(None, None, None)


def hf_ids(hf, messages: list[dict], **kw) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def server_ids(client, messages: list[dict], **kw) -> list[int]:
    """The prompt's tokens as /tokenize gives them, checked against the count
    /v1/chat/completions bills for the same request."""
    r = client.post("/tokenize", json={"model": "m", "messages": messages, **kw})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1, **kw})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    return ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_conversation_renders_as_transformers_does(served, family):
    client, hf, _ = served(family)
    chat = CHAT
    if family == "gemma2":  # its template raises on a system turn: so does the server, as a 400
        with pytest.raises(Exception, match="System role not supported"):
            hf_ids(hf, CHAT)
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 1})
        assert r.status_code == 400 and "System role not supported" in r.json()["error"]["message"]
        chat = CHAT[1:]
    assert server_ids(client, chat) == hf_ids(hf, chat)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tools_and_tool_turns_render_as_the_template_does(served, family):
    """With tool syntax: the template's own rendering of the tools and of a history with a
    call and its result. Without: the fallback (tools in the system turn, or the first user
    turn where there is no system role; calls as Hermes blocks; results as user turns)."""
    client, hf, _ = served(family)
    if FAMILIES[family][2] is not None:
        for chat in (CHAT, HF_HISTORY):
            wire = HISTORY if chat is HF_HISTORY else chat
            assert server_ids(client, wire, tools=[WEATHER]) == hf_ids(hf, chat, tools=[WEATHER])
        assert server_ids(client, CHAT, tools=[WEATHER]) != server_ids(client, CHAT)  # the tools were shown
        return
    intro = fallback_system_text(plan_tools([Tool.model_validate(WEATHER)], "auto", True, False))
    first = ([{"role": "user", "content": f"{intro}\n\nWeather in Rome?"}] if family == "gemma2"
             else [{"role": "system", "content": intro}, HISTORY[0]])
    want = first + [{"role": "assistant", "content": call_block(*ROME)},
                    {"role": "user", "content": "<tool_response>\nsunny, 24 C\n</tool_response>"}]
    assert server_ids(client, HISTORY, tools=[WEATHER]) == hf_ids(hf, want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_familys_calls_come_back_as_tool_calls(served, family):
    """--tool-call-parser auto reads the family's parser off the served template; a call in
    the family's syntax (a tiny random model writes none) parses, whole and streamed."""
    _, _, tokenizer = served(family)
    _, _, parser, (said, call) = FAMILIES[family]
    text = said + call
    syntax = resolve("auto", tokenizer)
    assert syntax.family == (parser or "hermes")
    plan = plan_tools([Tool.model_validate(WEATHER)], "auto", True, False, syntax.family)
    content, calls, complete = whole(plan, text)
    assert complete and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [ROME]
    assert content == (said or None)
    want = (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert replay(open_stream(plan), text, list(range(1, len(text)))) == want
