"""Forced tool calls honour the whole JSON schema in every format the registry knows, on both
engines: a tiny random-weight model decodes under the grammar the server builds (ChatFormatter,
tool_choice required or named) and the reply always parses as a call whose arguments validate
against the tool's schema (strings bounded by length, enum, const and pattern; integers and
numbers by their bounds; booleans; nullable values; arrays and objects; optional parameters).
The tokenizer holds every format's markers as single special tokens, as the real models do."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")

from promptcache.engines.base import SamplingParams  # noqa: E402
from promptcache.server.chat import Chat, ChatFormatter  # noqa: E402
from promptcache.tools import make_parser, parser_names  # noqa: E402
from promptcache.tools.registry import ALIASES  # noqa: E402

FORMATS = [n for n in parser_names() if n not in ALIASES]
MARKERS = tuple(sorted({m for n in FORMATS for m in make_parser(n).markers}))
MAX_TOKENS = 320  # far above any call these schemas allow; a call cut short fails the test
EXAMPLES = 3  # per format and engine: 10 formats x 2 engines x 3 = 60 forced calls

PATTERNS = ["^[A-Z]{3}$", "^[a-z]{1,4}-[0-9]{2}$", "^(yes|no|maybe)$", r"^\d{2,4}$",
            "^[^<>\\n]{1,8}$", r"^\w+$", "ab", r"^x(\.y)?$", "^(?:[a-c]|z)+$"]  # fmt: skip
WORDS = ["Paris", "Tokyo", "New York", "a<b", "", "x\ny", "42", "true"]


def _bounds(draw, integer: bool) -> dict:
    low = draw(st.integers(-50, 50) if integer else st.sampled_from([-2.5, 0, 0.25, 7]))
    width = draw(st.integers(0, 60) if integer else st.sampled_from([0.5, 1, 12.75]))
    kinds = draw(st.sampled_from(["closed", "exclusive", "low", "high"]))
    if kinds == "closed":
        return {"minimum": low, "maximum": low + width}
    if kinds == "exclusive":
        return {"exclusiveMinimum": low, "exclusiveMaximum": low + width + 2}
    return {"minimum": low} if kinds == "low" else {"maximum": low}


@st.composite
def param_schemas(draw) -> dict:
    kind = draw(st.sampled_from(["string", "pattern", "enum", "const", "integer", "number",
                                 "boolean", "nullable", "array", "object"]))  # fmt: skip
    if kind == "string":
        low = draw(st.integers(0, 3))
        return {"type": "string", "minLength": low, "maxLength": low + draw(st.integers(0, 10))}
    if kind == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(PATTERNS)), "maxLength": 12}
    if kind == "enum":
        words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4, unique=True))
        return {"type": "string", "enum": words}
    if kind == "const":
        return {"const": draw(st.sampled_from(["fixed", "New York", 3, True]))}
    if kind in ("integer", "number"):
        return {"type": kind, **_bounds(draw, kind == "integer")}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "nullable":
        if draw(st.booleans()):
            return {"type": ["string", "null"], "maxLength": 6}
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 99}
    if kind == "array":
        return {"type": "array", "maxItems": 3,
                "items": {"type": "integer", "minimum": 0, "maximum": 9}}  # fmt: skip
    return {"type": "object", "properties": {"k": {"type": "string", "maxLength": 4}},
            "required": ["k"]}  # fmt: skip


@st.composite
def tool_schemas(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(["city", "code", "days", "rate", "flag", "note"]),
                         min_size=1, max_size=3, unique=True))  # fmt: skip
    props = {k: draw(param_schemas()) for k in keys}
    required = [k for k in keys if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required}


OTHER = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["id"]}}}  # fmt: skip


def tiny_tokenizer():
    from promptcache.testing.tiny_models import train_tiny_tokenizer

    return train_tiny_tokenizer(MARKERS)


def torch_engine():
    pytest.importorskip("torch")
    import torch
    from transformers import AutoModelForCausalLM

    from promptcache.engines.torch.engine import TorchEngine
    from promptcache.testing.tiny_models import tiny_config

    tok = tiny_tokenizer()
    config = tiny_config("llama")
    config.vocab_size, config.eos_token_id = len(tok), tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return TorchEngine(model, tok, cache_enabled=False)


def mlx_engine():
    pytest.importorskip("mlx_lm")
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from promptcache.engines.mlx.engine import MlxEngine
    from promptcache.testing.tiny_models import mlx_tiny_model

    tok = tiny_tokenizer()
    model = mlx_tiny_model("llama", vocab_size=len(tok))
    return MlxEngine(model, TokenizerWrapper(tok), cache_enabled=False)  # as mlx_lm.load gives


@pytest.fixture(scope="module", params=["torch", "mlx"])
def engine(request):
    built = torch_engine() if request.param == "torch" else mlx_engine()
    return built, {}  # the engine and its formatters by format


def forced_call(
    engine, formatters, fmt, schema, named, temperature, seed
) -> tuple[Chat, object, str]:
    """The reply to a request forcing a call of tool ``pick`` (``schema``) in format ``fmt``."""
    if fmt not in formatters:
        formatters[fmt] = ChatFormatter(engine, tool_parser=fmt)
    formatter = formatters[fmt]
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    chat = Chat([{"role": "user", "content": "Pick one."}], [tool, OTHER],
                tool_choice="named" if named else "required", tool_name="pick" if named else None,
                parallel_tool_calls=False)  # fmt: skip
    prompt = formatter.render(chat)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                            grammar=formatter.grammar(chat))  # fmt: skip
    done = list(engine.generate(prompt, params))[-1]
    return chat, formatter.parse(chat, done.text), done.reason


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(schema=tool_schemas(), named=st.booleans(), temperature=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_forced_calls_parse_with_schema_valid_arguments(
    engine, fmt, schema, named, temperature, seed
):
    built, formatters = engine
    chat, reply, reason = forced_call(built, formatters, fmt, schema, named, temperature, seed)
    assert reason == "stop" and len(reply.calls) == 1, (reason, reply)
    call = reply.calls[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in chat.tools}
    assert call.name == "pick" or not named and call.name == "lookup", call
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert not reply.content


# -- the issue's case over HTTP: Qwen3.5's XML format, a string of maxLength 12, required ----

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"]}}}  # fmt: skip


@pytest.fixture(scope="module", params=["torch", "mlx"])
def qwen_server(request, tmp_path_factory):
    """A tiny random model with Qwen3.5's chat template (XML calls, <think> opened by the
    generation prompt) served on each engine."""
    pytest.importorskip("torch" if request.param == "torch" else "mlx_lm")
    pytest.importorskip("openai")
    from agent_models import QWEN35_SPECIALS, QWEN35_TEMPLATE
    from conftest import ServerProcess

    from promptcache.testing.tiny_models import (
        save_mlx_tiny_model,
        save_tiny_model,
        train_tiny_tokenizer,
    )

    home = tmp_path_factory.mktemp(f"qwen-xml-{request.param}")
    tok = train_tiny_tokenizer(QWEN35_SPECIALS, QWEN35_TEMPLATE)
    save = save_tiny_model if request.param == "torch" else save_mlx_tiny_model
    model = save("llama", str(home / "model"), tokenizer=tok)
    args = ["--engine", request.param, "--model", model, "--max-context", "4096"]
    srv = ServerProcess(args, env={"PROMPTCACHE_HOME": str(home)}, log=home / "server.log")
    yield srv.start()
    srv.stop()


@pytest.mark.server
def test_the_issue_case_over_http_comes_back_a_valid_call(qwen_server):
    import openai

    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for temperature, seed in ((0, None), (1, 1), (1, 2)):
        r = client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER], tool_choice="required",
            max_tokens=200, temperature=temperature, seed=seed,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:  # parallel calls allowed: each one whole
            assert call.function.name == "get_weather"
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, WEATHER["function"]["parameters"])
