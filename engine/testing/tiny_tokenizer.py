"""Write a tiny Qwen-style tokenizer: a byte-level BPE of a few hundred tokens and a Qwen3.5/3.6 chat template.

Tiny checkpoints get a real tokenizer folder (tokenizer.json, tokenizer_config.json, chat_template.jinja)
so the chat path can be tested end to end without downloading anything. The BPE is trained in memory
from the corpus below, so every byte is encodable and CJK characters and emoji span several tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Order fixes the ids: <|im_end|> is 1, the eos_token_id the tiny model configs use.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>")

CORPUS = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France? Please answer in one word.<|im_end|>
<|im_start|>assistant
<think>
The user asks for the capital of France. That is Paris.
</think>

Paris.<|im_end|>
The quick brown fox jumps over the lazy dog. Hello, world! It's a fine day, isn't it?
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i}: {fibonacci(i)}")
你好，世界！今天天气很好，我们去公园散步吧。人工智能正在改变世界。
こんにちは、世界。日本語のテキストです。안녕하세요, 세계!
Grüße aus München. Ça va très bien, merci. ¿Dónde está la biblioteca? Привет, мир!
Emoji: 😀 😂 🎉 👍 🚀 ❤️ 👨‍👩‍👧 🇫🇷 — done ✅
"""


def _train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # all 256 bytes, so any text encodes
    tokenizer.train_from_iterator([CORPUS], trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the built-in corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}; "
            f"ask for a smaller vocabulary"
        )
    return tokenizer


def write_tiny_tokenizer(folder: Path, vocab_size: int = 320) -> dict:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into folder; return the special ids."""
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size <= minimum:
        raise ValueError(f"vocab_size must exceed {minimum} (special tokens plus the 256 bytes)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids = {
        name: tokenizer.token_to_id(token)
        for name, token in (
            ("eos", "<|im_end|>"),
            ("im_start", "<|im_start|>"),
            ("endoftext", "<|endoftext|>"),
            ("think_start", "<think>"),
            ("think_end", "</think>"),
        )
    }
    return ids


# Qwen3.6's template for text: contents are trimmed; tools go into the system turn in the XML function
# format; reasoning is kept only for assistant turns after the last user query, or for all of them with
# preserve_thinking; a thinking reply is opened.
CHAT_TEMPLATE = """\
{%- macro text_of(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for part in content %}
            {%- if 'text' in part %}
                {{- part.text }}
            {%- else %}
                {{- raise_exception('This model reads text only; remove images and videos from the message.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none and content is defined %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>' }}
    {{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n'
        '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n'
        '</parameter>\\n<parameter=example_parameter_2>\\nThis is the value for the second parameter\\n'
        'that can span\\nmultiple lines\\n</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n'
        '- Function calls MUST follow the specified format: an inner <function=...></function> block must be '
        'nested within <tool_call></tool_call> XML tags\\n- Required parameters MUST be specified\\n'
        '- You may provide optional reasoning for your function call in natural language BEFORE the function '
        'call, but NOT after\\n- If there is no function call available, answer the question like normal with '
        'your current knowledge and do not tell the user about function calls\\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set system = text_of(messages[0].content) | trim %}
        {%- if system %}
            {{- '\\n\\n' + system }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + text_of(messages[0].content) | trim + '<|im_end|>\\n' }}
{%- endif %}
{#- The last user turn that is a real query, not a wrapped tool response, starts the current reply. #}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- if ns.multi_step_tool and message.role == 'user' %}
        {%- set content = text_of(message.content) | trim %}
        {%- if not (content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = messages | length - 1 - loop.index0 %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text_of(message.content) | trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- set reasoning = reasoning | trim %}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if not loop.first %}
                    {{- '\\n' }}
                {%- elif content | trim %}
                    {{- '\\n\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
                {%- if tool_call.arguments is defined %}
                    {%- for name, value in tool_call.arguments | items %}
                        {{- '<parameter=' + name + '>\\n' }}
                        {{- value if value is string else value | tojson }}
                        {{- '\\n</parameter>\\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {#- Consecutive tool results share one user turn. #}
        {%- if loop.previtem and loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""
