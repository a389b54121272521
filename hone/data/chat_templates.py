"""Chat templates shipped with hone, selected by name with ``data.chat_template: chatml``.

Each is the published format of a model family, written as the Jinja text a tokenizer would
carry, and rendered by the same code as a tokenizer's own template (``hone.data.chat``). They
take ``bos_token`` / ``eos_token`` from the tokenizer, so the special tokens are the model's.

Every template here renders a message the same way whatever follows it (a prefix of the
conversation renders to a prefix of the text), which is what lets ``hone.data.chat`` find each
message's span by rendering prefixes; ``add_generation_prompt`` writes the header of an
assistant turn, so that header is context and the reply (with its end-of-turn token) is trained.

Where a family's own template rewrites earlier turns, the template here does not:

- ``qwen3``: Qwen3's template writes the ``<think>...</think>`` block only for assistant turns
  after the last user message and drops it from earlier ones; here every assistant turn has
  its block (empty, ``<think>\\n\\n</think>\\n\\n``, unless the message carries
  ``reasoning_content``), which is Qwen3's own rendering of a single-turn conversation.

The names (and aliases) are listed in :data:`hone.config.data.CHAT_TEMPLATE_NAMES`, where the
config validator reads them; a test checks that both lists agree.
"""

from __future__ import annotations

#: ChatML (``<|im_start|>role\n...<|im_end|>\n``), used by Qwen, Hermes, SmolLM and others.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Llama 3 / 3.1 / 3.2 / 3.3 Instruct (without the tool and date preamble of 3.1's template).
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

#: Qwen2 Instruct: ChatML with a default system message when the conversation has none.
QWEN2 = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Qwen2.5 Instruct: as Qwen2, with Qwen2.5's default system message.
QWEN2_5 = QWEN2.replace("You are a helpful assistant.", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")

#: Qwen3: ChatML, assistant turns opening with their ``<think>`` block (see the module docstring).
QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + message['content'].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

#: Mistral Instruct (``[INST] ... [/INST]``, v0.1 to v0.3 text format); a system message is
#: written before the first user message inside its ``[INST]``.
MISTRAL = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\\n\\n' %}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- set ns.system = '' %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('the mistral template has no ' + message['role'] + ' role') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

#: Gemma / Gemma 2 / Gemma 3 (``<start_of_turn>user|model``); a system message is written at
#: the start of the first user turn, as Gemma 3's template does.
GEMMA = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] | trim + '\\n\\n' %}"
    "{%- else %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + ns.system + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- set ns.system = '' %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

#: Name -> template; aliases (Axolotl's spellings among them) share one text.
TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "qwen2": QWEN2,
    "qwen2.5": QWEN2_5,
    "qwen_25": QWEN2_5,
    "qwen3": QWEN3,
    "mistral": MISTRAL,
    "gemma": GEMMA,
    "gemma2": GEMMA,
    "gemma3": GEMMA,
}


def named_template(name: str) -> str | None:
    """The template ``name`` selects, or None when it is not one of :data:`TEMPLATES`."""
    return TEMPLATES.get(name.strip().lower())
