"""Tiny random models of the agent families, with chat templates written from each family's
published format: Qwen3.5/3.6 (model_type qwen3_5: Gated DeltaNet + attention, XML tool calls,
``<think>`` opened by the generation prompt) and gpt-oss (harmony channels)."""

from __future__ import annotations

from typing import Any

QWEN35_SPECIALS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                   "</tool_response>")  # fmt: skip
# Qwen3.5-style: tools as JSON lines in the system turn, XML calls, the reasoning of turns after
# the last user message kept as <think> blocks, <think>\n opening the generation prompt
QWEN35_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- if tools or messages[0].role == 'system' -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% if tools %}

{% endif %}{% endif %}{% if tools %}# Tools

You have access to the following functions:

<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>

If you choose to call a function, reply in this format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call>{% endif %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role in ('user', 'system') -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_user %}<think>
{{ (m.reasoning_content or '') | trim }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}{% set f = tc.function %}{% if not loop.first or m.content %}
{% endif %}<tool_call>
<function={{ f.name }}>
{% for k, v in f.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ m.content }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|return|>", "<|call|>")  # fmt: skip
# gpt-oss' harmony: system and developer messages, tools as a functions namespace, calls on the
# commentary channel to=functions.NAME, results from functions.NAME to=assistant
HARMONY_TEMPLATE = r"""{%- set ns = namespace(tool='') -%}
<|start|>system<|message|>You are ChatGPT, a large language model.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools or messages[0].role == 'system' -%}
<|start|>developer<|message|>{% if messages[0].role == 'system' %}# Instructions

{{ messages[0].content }}{% if tools %}

{% endif %}{% endif %}{% if tools %}# Tools

## functions

namespace functions {
{% for t in tools %}
// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions{% endif %}<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role in ('user', 'system') -%}
<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls -%}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif -%}
{%- for tc in m.tool_calls %}{% set ns.tool = tc.function.name -%}
<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>
{%- endfor -%}
{%- elif m.role == 'assistant' -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' -%}
<|start|>functions.{{ ns.tool }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")  # fmt: skip
# DeepSeek V3.1 in non-thinking mode: the generation prompt closes the think block, calls are
# name<｜tool▁sep｜>arguments with the arguments string concatenated as the client sent it
DEEPSEEK_TEMPLATE = r"""<｜begin▁of▁sentence｜>{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif -%}
{% if tools %}

## Tools
You have access to the following tools:
{% for t in tools %}
### {{ t.function.name }}
Description: {{ t.function.description }}

Parameters: {{ t.function.parameters | tojson }}
{% endfor %}
IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{ '{{additional_tool_calls}}' }}<｜tool▁calls▁end｜>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' -%}<｜Assistant｜></think>{{ m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.function.name }}<｜tool▁sep｜>{{ tc.function.arguments }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' -%}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"""


def save_agent_model(kind: str, folder: str, seed: int = 0) -> str:
    """A tiny random model of ``kind`` ("qwen3_5", "gpt_oss", or "deepseek_v31": a Llama body
    with DeepSeek V3.1's format): 2 layers, hidden 64,
    initializer_range 0.2, a trained BPE tokenizer with the family's markers as special tokens
    and the family's chat template. Returns the folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from promptcache.testing.tiny_models import train_tiny_tokenizer

    common: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  initializer_range=0.2, max_position_embeddings=4096)  # fmt: skip
    if kind == "qwen3_5":
        tok = train_tiny_tokenizer(QWEN35_SPECIALS, QWEN35_TEMPLATE)
        config = AutoConfig.for_model(
            "qwen3_5_text", **common, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4,
        )  # fmt: skip
        eos = [tok.eos_token_id]
    elif kind == "gpt_oss":
        tok = train_tiny_tokenizer(HARMONY_SPECIALS, HARMONY_TEMPLATE)
        config = AutoConfig.for_model(
            "gpt_oss", **{**common, "intermediate_size": 64}, num_local_experts=2,
            num_experts_per_tok=1, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        eos = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    elif kind == "deepseek_v31":
        tok = train_tiny_tokenizer(DEEPSEEK_SPECIALS, DEEPSEEK_TEMPLATE)
        tok.eos_token = "<｜end▁of▁sentence｜>"
        config = AutoConfig.for_model("llama", **common)
        eos = [tok.eos_token_id]
    else:
        raise ValueError(f"unknown agent model kind {kind!r}")
    config.vocab_size = len(tok)
    config.eos_token_id = eos if len(eos) > 1 else eos[0]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
