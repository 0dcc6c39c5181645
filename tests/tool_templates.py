"""Zoo models that can chat and call tools: a tiny byte-level BPE tokenizer (fits the zoo's 512-token vocabulary)
and a chat template per tool-call format, written here after the shape of the family's own templates, so that the
server's native tool formats (``ringshm.server.tool_formats``) run end to end on random-weight models with a
transformers oracle.

``tool_model(family, root)`` -> ``ZooModel`` whose HF directory carries the tokenizer and template:

- ``qwen2``: ``hermes``; turns ``<|im_start|>`` / ``<|im_end|>`` (EOS, special); ``<tool_call>`` and
  ``</tool_call>`` added tokens that are not special (as Qwen 2.5's).
- ``llama3``: ``llama3_json``; headers ``<|start_header_id|>`` / ``<|end_header_id|>``, ``<|eot_id|>`` (EOS); the
  call is a JSON object with ``"parameters"``, no marker.
- ``mistral``: ``mistral``; ``[INST]`` / ``[/INST]``, ``</s>`` (EOS); ``[TOOL_CALLS]`` a special token (as in
  Mistral's v3 tokenizers).

The Mistral template refuses a call id that is not 9 letters and digits, as Mistral's own do.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

import zoo

VOCAB = 512

HERMES = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\n"
    "For each call, write a JSON object with the function name and arguments within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA3 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
    "{%- if tools and loop.last and m.role == 'user' %}\n\nGiven the following functions, respond with a JSON for a "
    "function call with its proper arguments that best answers the prompt, in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.\n"
    "{%- for t in tools %}\n{{ t | tojson }}{% endfor %}{% endif %}<|eot_id|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

MISTRAL = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id | length != 9 %}{{ raise_exception('a tool call id must be 9 letters and digits') }}"
    "{%- endif %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, \"call_id\": \"{{ m.tool_call_id }}\"}"
    "[/TOOL_RESULTS]"
    "{%- elif m.tool_calls %}[TOOL_CALLS]["
    "{%- for c in m.tool_calls %}{% if c.id | length != 9 %}"
    "{{ raise_exception('a tool call id must be 9 letters and digits') }}{% endif %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": "
    "\"{{ c.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{%- elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{%- else %}[INST]{{ m.content }}[/INST]{% endif %}"
    "{%- endfor %}")

SPECS = {  # family -> (format, template, special tokens, added non-special tokens, EOS)
    "qwen2": ("hermes", HERMES, ["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], "<|im_end|>"),
    "llama3": ("llama3_json", LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [], "<|eot_id|>"),
    "mistral": ("mistral", MISTRAL, ["</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "</s>"),
}

_CORPUS = [
    "What is the weather in Paris? It is sunny and 18 degrees in the city today.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "add", "parameters": {"a": 1, "b": 2}} {"type": "object", "properties": {}}',
    "You may call one or more functions to answer the question of the user. Their signatures follow.",
    "Given the following functions, respond with a JSON for a function call with its proper arguments.",
    "The quick brown fox jumps over the lazy dog. 0123456789 ,.:;!?'\"()[]{}<>-_/\\",
]


def build_tokenizer(family: str):
    """A transformers fast tokenizer of ``VOCAB`` tokens (byte-level BPE trained on a few lines, plus the family's
    special and added tokens) with the family's chat template; ids 0 .. VOCAB-1 all decode."""
    from transformers import PreTrainedTokenizerFast

    _, template, specials, added, eos = SPECS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(added), special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, chat_template=template)
    assert len(fast) <= VOCAB, len(fast)
    return fast


def tool_model(family: str, root: str | Path, seed: int = 0) -> zoo.ZooModel:
    """The zoo's ``family`` model (``SPECS``' families) with ``build_tokenizer``'s tokenizer saved into its HF
    directory, its EOS id in the config and a 2048-token context."""
    tok = build_tokenizer(family)
    eos = tok.convert_tokens_to_ids(SPECS[family][4])
    model = zoo.build(family, root, seed=seed, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
                      max_position_embeddings=2048)  # tools take ~400 of these tokens
    tok.save_pretrained(str(model.hf_dir))
    return model
